"""A stand-in server process for the colocated launcher's tests: a real process with an
HTTP listener, as prefill and vLLM are, whose start, readiness, exit and SIGTERM show up
in files the tests read.

``python tests/operator/colocated_child.py PORT LOGDIR NAME [--ready-after S]
[--exit-after S --exit-code N] [--record-env VAR ...]``

* ``/health`` answers 200 at once, ``/ready`` 200 after ``--ready-after`` seconds;
* ``LOGDIR/NAME.started`` (a wall-clock time) when it listens, ``NAME.ready`` when
  ``/ready`` first answers 200, ``NAME.sigterm`` on SIGTERM (then it exits 0),
  ``NAME.env`` the ``--record-env`` variables (JSON, null where unset);
* ``--exit-after``: exits with ``--exit-code`` that long after starting.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("logdir", type=Path)
    p.add_argument("name")
    p.add_argument("--ready-after", type=float, default=0.0)
    p.add_argument("--exit-after", type=float, default=None)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--record-env", nargs="*", default=[])
    args = p.parse_args()
    start = time.monotonic()
    log: Path = args.logdir

    def mark(what: str, text: str | None = None) -> None:
        (log / f"{args.name}.{what}").write_text(text if text is not None else repr(time.time()))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/health" or (
                self.path == "/ready" and time.monotonic() - start >= args.ready_after
            )
            if ok and self.path == "/ready" and not (log / f"{args.name}.ready").exists():
                mark("ready")
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *a: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    mark("env", json.dumps({v: os.environ.get(v) for v in args.record_env}))
    mark("started")
    stop = threading.Event()

    def on_term(_sig: int, _frame: object) -> None:
        mark("sigterm")
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    timeout = None if args.exit_after is None else args.exit_after
    stopped = stop.wait(timeout)
    server.shutdown()
    return 0 if stopped else args.exit_code


if __name__ == "__main__":
    sys.exit(main())
