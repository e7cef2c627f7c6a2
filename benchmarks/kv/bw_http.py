"""The ``http pull`` and ``http write+pull`` rows of benchmarks/kv/bandwidth.py: today's
``http`` transport with the project's real pieces.

* ``http pull`` — the prefill's KV listener app
  (:func:`flowprefill.prefill.server.kv_http.create_kv_app` over a
  :class:`~flowprefill.kv.SharedDirTransport` directory) under uvicorn in a subprocess
  (multiprocessing, spawn: the child imports this module to find :func:`_serve_kv`), and
  the decode side's :class:`~flowprefill.kv.HTTPPullTransport` ``fetch()`` pulling
  ``GET /v1/kv/<id>`` into its cache directory (temp file, size checks, rename).
* ``http write+pull`` — that pull plus the producer's ``SharedDirTransport.put`` of the
  hand-off (safetensors write into the page cache + atomic rename), in sequence.

What is timed: ``put`` (write) and ``fetch`` (pull) separately. Not timed: ``build_handoff``
(validation + CRC-32 of the tensors; benchmarks/kv/handoff.py times it), and the CRC-32
pass over every byte that decode's ``fetch`` runs by default (``verify_checksum``;
handoff.py's ``verify_ms``) — it is switched off here so the pull is comparable with the
raw NIXL READ. The pull is preceded by the transport's own ``header()`` range request, as
in decode (the scheduler reads the header first), which also opens the keep-alive
connection (the warm-up). The served file was just written, so it is read from the page
cache, as on a prefill instance; dirty pages of earlier cells being written back to disk
add noise to every transport.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from benchmarks.kv.bw_common import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    TOKEN_BYTES,
    check_received,
    file_crc32,
    fill_pattern,
)


def _serve_kv(root: str, port: int) -> None:
    """The prefill's KV listener app over ``root``, as the prefill server runs it."""
    import uvicorn

    from flowprefill.kv import SharedDirTransport
    from flowprefill.prefill.server.kv_http import create_kv_app

    app = create_kv_app(SharedDirTransport(root))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


class HTTPPath:
    """The ``http`` transport: a KV listener subprocess over ``<work>/prefill`` and a decode
    side pulling into ``<work>/decode-cache``. Use as a context manager (stops the server)."""

    def __init__(self, work: Path) -> None:
        from flowprefill.kv import HTTPPullTransport, SharedDirTransport

        self.port = _free_port()
        self.source = f"http://127.0.0.1:{self.port}"
        self.store = SharedDirTransport(work / "prefill")
        self.puller = HTTPPullTransport(
            work / "decode-cache", max_download_s=3600.0, verify_checksum=False
        )
        ctx = mp.get_context("spawn")
        self.server = ctx.Process(
            target=_serve_kv, args=(str(self.store.root), self.port), name="kv-listener"
        )
        self.server.start()
        self._wait_healthy(120.0)

    def _wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.server.is_alive():
                raise RuntimeError(f"KV listener exited with {self.server.exitcode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.source}/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"KV listener on {self.source} not healthy within {timeout_s:.0f} s")

    def run(self, nbytes: int, seed: int, handoff_id: str) -> tuple[float, float, dict[str, Any]]:
        """Write a ``nbytes`` hand-off and pull it; (write seconds, pull seconds, details)."""
        import torch

        from flowprefill.contracts.kv import HandoffRef
        from flowprefill.kv import ModelFingerprint, build_handoff

        tokens = nbytes // TOKEN_BYTES
        storage = torch.empty(nbytes, dtype=torch.uint8)
        fill_pattern(storage.numpy(), seed)
        kv = storage.view(torch.bfloat16).view(LAYERS, 2, KV_HEADS, tokens, HEAD_DIM)
        fingerprint = ModelFingerprint(
            model_type="llama",
            num_layers=LAYERS,
            num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            hidden_size=4096,
            vocab_size=128256,
            rope_theta=500000.0,
        )
        layers = [(kv[i, 0], kv[i, 1]) for i in range(LAYERS)]  # contiguous views, no copy
        handoff = build_handoff(layers, range(3, 3 + tokens), fingerprint)
        t0 = time.perf_counter()
        self.store.put(handoff_id, handoff)
        write_s = time.perf_counter() - t0
        del handoff, layers, kv, storage  # the pull needs none of it: keep memory low
        served = self.store.path(handoff_id)
        file_bytes = served.stat().st_size
        sent_crc = file_crc32(served)
        ref = HandoffRef(handoff_id, source=self.source)
        try:
            self.puller.header(ref)  # as decode's scheduler does; opens the connection
            t0 = time.perf_counter()
            local = self.puller.fetch(ref)
            pull_s = time.perf_counter() - t0
            check_received(f"http pull of {handoff_id}", sent_crc, file_crc32(local))
        finally:
            self.puller.delete(ref, wait=True)  # local copy, and DELETE at the listener
            self.store.delete(handoff_id)  # in case the DELETE did not get through
        return write_s, pull_s, {"file_bytes": file_bytes}

    def __enter__(self) -> HTTPPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.puller.close()
        self.server.terminate()  # our own child, by handle
        self.server.join(timeout=10.0)
        if self.server.is_alive():
            self.server.kill()
            self.server.join()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
