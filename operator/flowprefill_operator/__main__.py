"""``python -m flowprefill_operator crdgen [--check] [--root DIR]``.

Run the operator itself with ``kopf run -m flowprefill_operator.handlers`` (see the chart).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .crd import stale_files, write_crds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowprefill_operator")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "crdgen", help="write crds/ and charts/flowprefill/files/crds/ from the models"
    )
    gen.add_argument("--root", type=Path, default=Path.cwd(), help="repository root")
    gen.add_argument("--check", action="store_true", help="only report stale files (exit 1)")
    args = parser.parse_args(argv)

    if args.check:
        stale = stale_files(args.root)
        for path in stale:
            print(f"stale: {path}", file=sys.stderr)
        return 1 if stale else 0
    for path in write_crds(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
