"""The stack benchmarks' servers live in sessions of their own: a benchmark stopped with
SIGTERM (``kill``, ``timeout``) must stop them on its way out, as Ctrl-C does."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

_BENCHMARK = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from benchmarks.stack.common import Server

    server = Server("s", [sys.executable, "-c", "import time; time.sleep(120)"],
                    ready_url="http://127.0.0.1:1/", base_url="http://127.0.0.1:1",
                    log=Path(sys.argv[1]))
    try:
        server.start()
        print(server.proc.pid, flush=True)
        time.sleep(120)
    finally:
        server.stop()
    """
)


def test_sigterm_stops_the_benchmarks_servers(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-c", _BENCHMARK, str(tmp_path / "s.log")],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert bench.stdout is not None
    server_pid = int(bench.stdout.readline())
    assert psutil.pid_exists(server_pid)
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while psutil.pid_exists(server_pid) and psutil.Process(server_pid).status() != "zombie":
        assert time.monotonic() < deadline, "the server outlived the benchmark"
        time.sleep(0.05)
