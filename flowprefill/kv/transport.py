"""Where hand-offs live between the prefill instance and a decode instance.

A transport stores and fetches :class:`~flowprefill.kv.format.KVHandoff` objects by a
*hand-off id* (the gateway passes the id, and where relevant the ``source`` URL, to decode
in ``kv_transfer_params``; see :class:`~flowprefill.kv.params.HandoffRef`). Two exist:

* :class:`SharedDirTransport` (``shared_dir``): a directory both processes see (one
  machine, or a ReadWriteMany volume mounted in prefill and decode pods).
* :class:`HTTPPullTransport` (``http``): the prefill instance keeps hand-offs in its own
  directory (written with :class:`SharedDirTransport`) and serves them at
  ``GET /v1/kv/<id>``; decode pulls them into a local cache — header by a range request
  in the scheduler, the body in the worker.

The connector calls ``header()`` (scheduler), ``open()`` (worker) and ``delete()`` /
``discard()`` (request finished) with the request's ``HandoffRef``; the prefill side only
calls ``put()``. Other transports (NIXL/RDMA, an object store) implement the same
protocol and register a name in :func:`make_transport`; the connector picks one with
``kv_connector_extra_config["transport"]``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import httpx

from flowprefill.contracts.deployment import KV_HTTP_PATH, default_kv_cache_dir, default_kv_dir
from flowprefill.contracts.kv import HandoffRef, check_handoff_id
from flowprefill.errors import KVFormatError, KVHandoffError, KVNotFoundError
from flowprefill.kv.format import (
    KVHandoff,
    KVHeader,
    KVReader,
    file_header_length,
    parse_file_header,
    read_header,
    write_handoff,
)


def default_storage_path() -> str:
    """``$FLOWPREFILL_KV_DIR`` or /tmp/flowprefill-kv: what producer and consumer share when
    neither is configured explicitly (one machine, or one volume mounted at that path)."""
    return default_kv_dir()


SUFFIX = ".kv.safetensors"

HandoffKey = str | HandoffRef
"""A hand-off by id (enough for a shared directory) or by reference (id + ``source``)."""


def _split(handoff: HandoffKey) -> tuple[str, str | None]:
    if isinstance(handoff, str):
        return check_handoff_id(handoff), None
    return check_handoff_id(handoff.handoff_id), handoff.source


class KVTransport(Protocol):
    """Stores hand-offs by id. Implementations must make ``put`` atomic: a reader sees
    either no hand-off or a complete one, never a partial write.

    The consumer-side methods take the decode request's :class:`HandoffRef` (or a bare id
    where the transport needs no more): ``header`` runs in vLLM's scheduler and must stay
    cheap, ``open`` runs in the worker before the forward pass, ``delete`` removes the
    hand-off (consumer done), ``discard`` drops only what the consumer itself keeps.
    """

    def put(self, handoff_id: str, handoff: KVHandoff) -> None: ...

    def open(self, handoff: HandoffKey) -> KVReader: ...

    def header(self, handoff: HandoffKey) -> KVHeader: ...

    def delete(self, handoff: HandoffKey) -> bool: ...

    def discard(self, handoff: HandoffKey) -> None: ...


class SharedDirTransport:
    """Hand-offs as ``<root>/<id>.kv.safetensors``, written atomically (temp file + rename).

    Orphans (a client that went away before decode) are removed by :meth:`sweep`; the
    connector deletes a hand-off when its request finishes (``delete_after_load``, default
    on).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, handoff: HandoffKey) -> Path:
        return self.root / f"{_split(handoff)[0]}{SUFFIX}"

    def put(self, handoff_id: str, handoff: KVHandoff) -> None:
        final = self.path(handoff_id)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            write_handoff(handoff, tmp)
            os.replace(tmp, final)  # atomic on POSIX within one filesystem
        finally:
            tmp.unlink(missing_ok=True)

    def open(self, handoff: HandoffKey) -> KVReader:
        path = self.path(handoff)
        if not path.is_file():
            raise KVNotFoundError(f"no KV hand-off {_split(handoff)[0]!r} in {self.root}")
        return KVReader(path)

    def header(self, handoff: HandoffKey) -> KVHeader:
        with self.open(handoff) as reader:
            return reader.header

    def delete(self, handoff: HandoffKey) -> bool:
        try:
            self.path(handoff).unlink()
        except FileNotFoundError:
            return False
        return True

    def discard(self, handoff: HandoffKey) -> None:
        return  # the consumer keeps no copy: the directory is the producer's

    def held_bytes(self) -> int:
        """Bytes of the hand-offs (and files being written) in the directory now."""
        total = 0
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.endswith(SUFFIX) or entry.name.endswith(".tmp"):
                    try:
                        total += entry.stat().st_size
                    except FileNotFoundError:  # consumed meanwhile
                        continue
        return total

    def sweep(self, max_age_s: float, now_s: float | None = None) -> int:
        """Delete hand-offs older than ``max_age_s`` (by mtime), and temp files as old (a
        writer killed mid-write leaves one: its ``finally`` never ran); returns how many."""
        cutoff = (time.time() if now_s is None else now_s) - max_age_s
        removed = 0
        written = self.root.glob(f"*{SUFFIX}")
        for path in itertools.chain(written, self.root.glob(f".*{SUFFIX}.*.tmp")):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # consumed concurrently
                continue
        return removed


HEADER_PROBE_BYTES = 64 * 1024
"""First range request of a header fetch: a hand-off's safetensors header is ~0.1 KiB per
layer plus ~0.5 KiB of metadata, so one round trip covers any model up to ~500 layers."""


def default_cache_path() -> str:
    """``$FLOWPREFILL_KV_CACHE_DIR`` or /tmp/flowprefill-kv-cache: the decode side's
    local copies of pulled hand-offs."""
    return default_kv_cache_dir()


class HTTPPullTransport:
    """Consumer side of the ``http`` transport: pull hand-offs from the prefill instance
    that wrote them (``<source>/v1/kv/<id>``, ``source`` from the request's
    :class:`HandoffRef`: that instance's KV listener, the one port of it decode reaches)
    into a local cache directory.

    * :meth:`header` (vLLM's scheduler): HTTP ``Range`` request for the safetensors header
      only (``HEADER_PROBE_BYTES``; a second request if the header is larger) — one round
      trip, no tensor data; validated like :class:`KVReader` does on open.
    * :meth:`open` (the worker, before the forward pass): download the whole file once into
      ``<cache_dir>/<id>.kv.safetensors`` — streamed to a temp file, size-checked against
      ``max_bytes``, ``Content-Length`` and the size the header implies, then renamed — and
      read it lazily from there; with ``verify_checksum`` (default) every byte is checked
      against the hand-off's token-id digest and CRC-32 first, since the bytes crossed the
      network from a peer that may be broken or hostile. Later calls use the local copy.
    * :meth:`delete`: remove the local copy and ``DELETE`` at the source (the same KV
      listener) in the background
      (best effort: the prefill side sweeps what is never deleted). :meth:`discard`: the
      local copy only.

    Every failure — HTTP error status, refused connection, a server that stalls longer than
    ``timeout_s`` between bytes (``header_timeout_s`` in total for the header, which the
    connector reads off vLLM's scheduler thread), a download over ``max_download_s`` in
    total, a body larger
    than ``max_bytes`` or shorter than announced — is a :class:`KVHandoffError`
    (:class:`KVNotFoundError` for 404) naming the URL; the connector then recomputes.
    Local copies older than ``cache_max_age_s`` are swept (a crashed request's leftovers).
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        timeout_s: float = 5.0,
        header_timeout_s: float = 1.0,
        max_download_s: float = 60.0,
        max_bytes: int = 32 * 2**30,
        cache_max_age_s: float = 600.0,
        verify_checksum: bool = True,
    ) -> None:
        if min(timeout_s, header_timeout_s, max_download_s, max_bytes) <= 0:
            raise KVHandoffError("http transport: timeouts and max_bytes must be positive")
        self.cache = SharedDirTransport(cache_dir or default_cache_path())
        self.timeout_s = float(timeout_s)
        self.header_timeout_s = float(header_timeout_s)
        self.max_download_s = float(max_download_s)
        self.max_bytes = int(max_bytes)
        self.cache_max_age_s = float(cache_max_age_s)
        self.verify_checksum = verify_checksum
        self._client: httpx.Client | None = None
        self._deleter: ThreadPoolExecutor | None = None
        self._pending: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._last_sweep = time.monotonic()
        self.cache.sweep(self.cache_max_age_s)

    @property
    def root(self) -> Path:
        return self.cache.root

    def url(self, handoff: HandoffKey) -> str:
        handoff_id, source = _split(handoff)
        if not source:
            raise KVHandoffError(
                f"hand-off {handoff_id!r} has no source URL: the http transport needs "
                "kv_transfer_params.flowprefill.source (a prefill server run with "
                "--kv-transport http)"
            )
        return f"{source}{KV_HTTP_PATH}{handoff_id}"

    # ------------------------------------------------------------------ protocol

    def put(self, handoff_id: str, handoff: KVHandoff) -> None:
        raise KVHandoffError(
            "the http transport is pull-only: the prefill server writes hand-offs to its own "
            "directory (SharedDirTransport) and serves them at /v1/kv/<id>"
        )

    def header(self, handoff: HandoffKey) -> KVHeader:
        local = self.cache.path(handoff)
        if local.is_file():
            return read_header(local)
        url = self.url(handoff)
        raw = self._get_range(url, 0, HEADER_PROBE_BYTES)
        end = file_header_length(raw, url)
        if len(raw) < end:
            raw += self._get_range(url, len(raw), end - len(raw))
        header, size = parse_file_header(raw, url)
        if size > self.max_bytes:
            raise KVHandoffError(f"{url}: hand-off of {size} bytes exceeds max_bytes")
        return header

    def open(self, handoff: HandoffKey) -> KVReader:
        local = self.cache.path(handoff)
        if not local.is_file():
            self.fetch(handoff)
        return KVReader(local)

    def delete(self, handoff: HandoffKey, *, wait: bool = False) -> bool:
        removed = self.cache.delete(handoff)
        if _split(handoff)[1]:
            url = self.url(handoff)
            with self._lock:
                if self._deleter is None:
                    self._deleter = ThreadPoolExecutor(2, thread_name_prefix="kv-http-delete")
                fut = self._deleter.submit(self._delete_remote, url)
                self._pending.add(fut)
            fut.add_done_callback(self._pending.discard)
            if wait:
                fut.result()
        return removed

    def discard(self, handoff: HandoffKey) -> None:
        self.cache.delete(handoff)

    def sweep(self, max_age_s: float | None = None) -> int:
        """Remove local copies older than ``max_age_s`` (default ``cache_max_age_s``)."""
        self._last_sweep = time.monotonic()
        return self.cache.sweep(self.cache_max_age_s if max_age_s is None else max_age_s)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait for background DELETEs (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        for fut in list(self._pending):
            with contextlib.suppress(Exception):
                fut.result(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.wait_idle()
        if self._deleter is not None:
            self._deleter.shutdown(wait=True)
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ transfer

    def fetch(self, handoff: HandoffKey) -> Path:
        """Download the hand-off into the local cache (atomically); returns its path."""
        final = self.cache.path(handoff)
        url = self.url(handoff)
        if time.monotonic() - self._last_sweep > self.cache_max_age_s / 4:
            self.sweep()
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        t0 = time.monotonic()
        try:
            with self._stream(url, {}, self.timeout_s) as resp:
                _check_status(resp, url, (200,))
                announced = _content_length(resp)
                if announced is not None and announced > self.max_bytes:
                    raise KVHandoffError(
                        f"{url}: hand-off of {announced} bytes exceeds max_bytes {self.max_bytes}"
                    )
                got = 0
                with tmp.open("wb") as out:
                    for chunk in self._chunks(resp, url, t0):
                        got += len(chunk)
                        if got > self.max_bytes:
                            raise KVHandoffError(
                                f"{url}: download exceeds max_bytes {self.max_bytes}; aborted"
                            )
                        out.write(chunk)
            if announced is not None and got != announced:
                raise KVFormatError(f"{url}: truncated download: {got} of {announced} bytes")
            with tmp.open("rb") as f:
                head = f.read(HEADER_PROBE_BYTES)
                end = file_header_length(head, url)
                if len(head) < end:
                    head += f.read(end - len(head))
            _, size = parse_file_header(head, url)
            if got != size:
                raise KVFormatError(
                    f"{url}: truncated hand-off: {got} bytes, its header implies {size}"
                )
            if self.verify_checksum:
                with KVReader(tmp) as reader:
                    reader.verify()
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return final

    def _get_range(self, url: str, start: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``start`` (fewer at the end of the file)."""
        t0 = time.monotonic()
        headers = {"Range": f"bytes={start}-{start + length - 1}"}
        with self._stream(url, headers, self.header_timeout_s) as resp:
            _check_status(resp, url, (200, 206))
            skip = start if resp.status_code == 200 else 0  # server ignored the range
            buf = bytearray()
            for chunk in self._chunks(resp, url, t0, self.header_timeout_s):
                buf += chunk
                if len(buf) >= skip + length:
                    break
        return bytes(buf[skip : skip + length])

    def _chunks(
        self, resp: httpx.Response, url: str, t0: float, budget_s: float | None = None
    ) -> Iterator[bytes]:
        budget = self.max_download_s if budget_s is None else budget_s
        for chunk in resp.iter_raw():  # as received: a chunk_size would buffer up to it
            yield chunk
            if time.monotonic() - t0 > budget:
                raise KVHandoffError(f"{url}: transfer took longer than {budget:g} s; aborted")

    @contextlib.contextmanager
    def _stream(
        self, url: str, headers: dict[str, str], timeout_s: float
    ) -> Iterator[httpx.Response]:
        """GET ``url`` streamed; transport failures become KVHandoffError naming it."""
        try:
            with self._http().stream("GET", url, headers=headers, timeout=timeout_s) as resp:
                yield resp
        except httpx.TimeoutException as exc:
            raise KVHandoffError(
                f"GET {url}: no response within {timeout_s:g} s ({type(exc).__name__})"
            ) from exc
        except httpx.HTTPError as exc:
            raise KVHandoffError(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                # trust_env=False: pod-to-pod traffic must not go through an HTTP(S)_PROXY.
                self._client = httpx.Client(
                    timeout=httpx.Timeout(self.timeout_s),
                    headers={"Accept-Encoding": "identity"},
                    follow_redirects=False,
                    trust_env=False,
                )
            return self._client

    def _delete_remote(self, url: str) -> None:
        try:
            resp = self._http().delete(url)
        except httpx.HTTPError as exc:
            _log_debug("DELETE %s failed: %s", url, exc)
            return
        if resp.status_code not in (200, 204, 404):
            _log_debug("DELETE %s: HTTP %d", url, resp.status_code)


def _log_debug(msg: str, *args: object) -> None:
    import logging

    logging.getLogger("vllm.flowprefill.kv.transport").debug(msg, *args)


def _content_length(resp: httpx.Response) -> int | None:
    value = resp.headers.get("content-length")
    return int(value) if value and value.isdigit() else None


def _check_status(resp: httpx.Response, url: str, ok: tuple[int, ...]) -> None:
    if resp.status_code in ok:
        return
    resp.read()
    try:
        message = str(json.loads(resp.content)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = resp.content[:200].decode(errors="replace")
    text = f"GET {url}: HTTP {resp.status_code}: {message}"
    if resp.status_code == 404:
        raise KVNotFoundError(text)
    raise KVHandoffError(text)


def make_transport(name: str, **options: object) -> KVTransport:
    """A transport by name.

    * ``shared_dir`` — option ``path`` (default :func:`default_storage_path`).
    * ``http`` — options ``cache_dir`` (default :func:`default_cache_path`), ``timeout_s``,
      ``header_timeout_s``,
      ``max_download_s``, ``max_bytes``, ``cache_max_age_s`` (see :class:`HTTPPullTransport`).

    Options a transport does not use are ignored (the connector passes its whole
    ``kv_connector_extra_config``).
    """
    if name == "shared_dir":
        path = options.get("path") or default_storage_path()
        if not isinstance(path, str | os.PathLike):
            raise KVHandoffError("shared_dir transport needs a 'path' option")
        return SharedDirTransport(path)
    if name == "http":
        cache_dir = options.get("cache_dir") or default_cache_path()
        if not isinstance(cache_dir, str | os.PathLike):
            raise KVHandoffError("http transport: 'cache_dir' must be a path")
        numbers: dict[str, float] = {}
        keys = ("timeout_s", "header_timeout_s", "max_download_s", "max_bytes", "cache_max_age_s")
        for key in keys:
            value = options.get(key)
            if value is None:
                continue
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise KVHandoffError(f"http transport: {key} must be a number, got {value!r}")
            numbers[key] = value
        return HTTPPullTransport(
            cache_dir,
            timeout_s=numbers.get("timeout_s", 5.0),
            header_timeout_s=numbers.get("header_timeout_s", 1.0),
            max_download_s=numbers.get("max_download_s", 60.0),
            max_bytes=int(numbers.get("max_bytes", 32 * 2**30)),
            cache_max_age_s=numbers.get("cache_max_age_s", 600.0),
        )
    raise KVHandoffError(f"unknown KV transport {name!r}; expected one of: shared_dir, http")
