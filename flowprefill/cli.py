"""``flowprefill`` command line: the processes (``up``, ``serve-prefill``,
``serve-gateway``, a pod's ``fetch-model`` step) and the tools (``bench``, ``profile``,
``simulate``, ``demo``).

A subcommand's module, and with it its dependencies (torch, transformers, the lab's
matplotlib), is imported only when that subcommand is chosen: ``flowprefill --help`` is
instant, each process needs only its own extra, and no serving process imports the lab
(tests/contracts/test_boundaries.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from flowprefill.errors import FlowPrefillError

Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _demo() -> Command:
    from flowprefill.lab import demo

    return demo.add_arguments, demo.run


def _profile() -> Command:
    from flowprefill.prefill.predictor import cli as profile_cli

    return profile_cli.add_arguments, profile_cli.run


def _simulate() -> Command:
    from flowprefill.lab.sim import cli as sim_cli

    return sim_cli.add_arguments, sim_cli.run


def _serve_prefill() -> Command:
    from flowprefill.prefill.server import cli as server_cli

    return server_cli.add_arguments, server_cli.run


def _serve_gateway() -> Command:
    from flowprefill.gateway import cli as gateway_cli

    return gateway_cli.add_arguments, gateway_cli.run


def _bench() -> Command:
    from flowprefill.bench import cli as bench_cli

    return bench_cli.add_arguments, bench_cli.run


def _fetch_model() -> Command:
    from flowprefill import fetch

    return fetch.add_arguments, fetch.run


def _up() -> Command:
    from flowprefill.stack import up

    return up.add_arguments, up.run


COMMANDS: dict[str, tuple[str, Callable[[], Command]]] = {
    "up": ("Gateway + prefill + decode instances on this machine, tiny built-in model", _up),
    "fetch-model": ("Download an hf:// model into a directory (a pod's init step)", _fetch_model),
    "demo": ("FlowPrefill vs FCFS on a tiny local model: per-class TTFT attainment", _demo),
    "profile": ("Fit the TTFT predictor on this engine and hardware", _profile),
    "simulate": ("Goodput of every policy at GPU scale (discrete-event simulator)", _simulate),
    "bench": ("Replay a workload against an OpenAI-compatible endpoint", _bench),
    "serve-prefill": ("Run one prefill instance over HTTP", _serve_prefill),
    "serve-gateway": ("Run the OpenAI-compatible gateway", _serve_gateway),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowprefill", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Only the chosen subcommand's module is imported (and so only its dependencies).
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (help_text, loader) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            add_arguments, run = loader()
            add_arguments(p)
            p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health probe
    try:
        code: int = args._run(args)
    except FlowPrefillError as e:
        print(f"flowprefill {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
