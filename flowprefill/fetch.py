"""``flowprefill fetch-model``: a pod's download step (an init container) for ``hf://``
model sources, and the check the operator runs before it creates pods.

The step lists the repository at one commit, skips what is already complete in the
destination, downloads the rest file by file with the official ``huggingface_hub`` client
(resumable, ``HF_TOKEN`` and ``HF_ENDPOINT`` honoured), and logs one progress line per
file. Weights in formats the engines do not load are skipped when safetensors exist (a
Llama repository also carries ``original/*.pth``, the same weights again).

Contract with the operator: exit 0 when the destination holds the repository at the
resolved commit (``.flowprefill-source.json`` records it); on failure a one-line
``<Reason>: <message>`` goes to stderr and to the termination-message file (the kubelet
copies it into the pod status, where the operator reads it into a ServingPool condition
and Event), exit 2 when retrying cannot help (no such repository, revision or file; a
refused token; not enough disk) and 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from flowprefill.contracts.deployment import HF_TOKEN_SOURCE_ENV
from flowprefill.contracts.model_uri import (
    TOKEN_ENV,
    TOKENIZER_FILES,
    HubSource,
    ModelURIError,
    parse_model_uri,
)

if TYPE_CHECKING:
    from huggingface_hub.hf_api import RepoSibling

log = logging.getLogger("flowprefill.fetch")

MARKER = ".flowprefill-source.json"
"""Written last into the destination: the URI, commit and files a complete download holds."""
TERMINATION_LOG = "/dev/termination-log"
"""Where the kubelet reads a container's termination message (Kubernetes' default path)."""
WEIGHT_FORMATS_SKIPPED = ("*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ckpt", "*.gguf",
                          "*.onnx", "*.onnx_data", "original/*", "*.tflite", "*.ot")  # fmt: skip
"""Skipped when the repository has ``*.safetensors`` (what vLLM and the engine load)."""
EXIT_RETRYABLE = 1
EXIT_PERMANENT = 2


class FetchFailure(Exception):
    """Why a download (or the operator's check) failed: a CamelCase ``reason`` for a
    condition, a ``message`` naming the source, and whether retrying can help."""

    def __init__(self, reason: str, message: str, permanent: bool) -> None:
        super().__init__(reason, message, permanent)
        self.reason, self.message, self.permanent = reason, message, permanent

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FetchFailure) and other.args == self.args

    def __hash__(self) -> int:
        return hash(self.args)

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def classify(error: BaseException, source: HubSource, *, token_from: str = "") -> FetchFailure:
    """The failure a ``huggingface_hub`` (or OS) error means for ``source``.

    ``token_from`` names where the token came from (e.g. ``Secret hf-token key HF_TOKEN``)
    so that a refused token's message says which one to fix.
    """
    from huggingface_hub import errors as hf

    uri = source.uri
    status = getattr(getattr(error, "response", None), "status_code", None)
    token = f"the token from {token_from}" if token_from else "the token"
    who = token if token_from else "no token was given (model.tokenSecretRef)"
    if isinstance(error, hf.GatedRepoError):
        return FetchFailure(
            "ModelGated",
            f"{uri} is gated and {who} has no access: accept the model's terms on the Hub "
            "with the token's account",
            permanent=True,
        )
    if isinstance(error, hf.RevisionNotFoundError):
        return FetchFailure(
            "ModelRevisionNotFound", f"{uri}: revision {source.revision!r} not found", True
        )
    if isinstance(error, hf.RepositoryNotFoundError):
        return FetchFailure(
            "ModelRepositoryNotFound",
            f"{uri}: repository not found (or private, and {who} cannot see it)",
            permanent=True,
        )
    if isinstance(error, hf.OfflineModeIsEnabled):
        return FetchFailure(
            "ModelHubOffline", f"{uri}: HF_HUB_OFFLINE is set where the download runs", True
        )
    if isinstance(error, hf.RemoteEntryNotFoundError):
        return FetchFailure("ModelFileNotFound", f"{uri}: {error}".splitlines()[0], True)
    if status == 401:
        return FetchFailure(
            "ModelTokenRefused",
            f"{uri}: the Hub refused {token} (401 Unauthorized: invalid or expired)",
            permanent=True,
        )
    if status == 403:
        return FetchFailure(
            "ModelAccessDenied", f"{uri}: {token} lacks read permission (403 Forbidden)", True
        )
    if isinstance(error, OSError) and error.errno == 28:  # ENOSPC
        return FetchFailure("ModelDiskFull", f"{uri}: no space left on the model cache", True)
    if isinstance(error, FetchFailure):
        return error
    kind = type(error).__name__
    detail = str(error).splitlines()[0] if str(error) else kind
    return FetchFailure("ModelDownloadFailed", f"{uri}: {kind}: {detail}", permanent=False)


def select_files(names: list[str], *, tokenizer_only: bool) -> list[str]:
    """The repository files a pod needs: the tokenizer's alone for the gateway; else all,
    less duplicate weight formats when safetensors exist."""
    if tokenizer_only:
        return sorted(n for n in names if n in TOKENIZER_FILES)
    has_safetensors = any(n.endswith(".safetensors") for n in names)
    keep = [
        n
        for n in names
        if not n.startswith(".")
        and not (has_safetensors and any(fnmatch.fnmatch(n, p) for p in WEIGHT_FORMATS_SKIPPED))
    ]
    return sorted(keep)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _complete(dest: Path, commit: str, files: list[RepoSibling]) -> bool:
    """Whether ``dest`` already holds these files at this commit (a previous pod's work)."""
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("commit") != commit:
        return False
    return all(
        (dest / f.rfilename).is_file()
        and (f.size is None or (dest / f.rfilename).stat().st_size == f.size)
        for f in files
    )


def fetch(
    source: HubSource,
    dest: Path,
    *,
    tokenizer_only: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
) -> Path:
    """Download ``source`` into ``dest`` (created); returns ``dest``. Raises
    :class:`FetchFailure` (classified) on any failure."""
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = api.model_info(source.repo_id, revision=source.revision, files_metadata=True)
        siblings = {s.rfilename: s for s in info.siblings or []}
        wanted = [siblings[n] for n in select_files(list(siblings), tokenizer_only=tokenizer_only)]
        commit = info.sha or source.revision
        if not wanted:
            what = "tokenizer files" if tokenizer_only else "files"
            raise FetchFailure("ModelFileNotFound", f"{source.uri}: the repository has no {what}",
                               permanent=True)  # fmt: skip
        total = sum(s.size or 0 for s in wanted)
        dest.mkdir(parents=True, exist_ok=True)
        if _complete(dest, commit, wanted):
            log.info("%s at %s: already in %s (%d files)", source.uri, commit[:12], dest,
                     len(wanted))  # fmt: skip
            return dest
        free = shutil.disk_usage(dest).free
        if free < total:
            raise FetchFailure(
                "ModelDiskFull",
                f"{source.uri} needs {_gib(total)} but the model cache has {_gib(free)} free",
                permanent=True,
            )
        log.info("%s at %s: %d files, %s -> %s", source.uri, commit[:12], len(wanted),
                 _gib(total), dest)  # fmt: skip
        started, done = time.monotonic(), 0
        for i, sibling in enumerate(wanted, 1):
            t0 = time.monotonic()
            hf_hub_download(
                source.repo_id,
                sibling.rfilename,
                revision=commit,  # every file from the one commit listed above
                local_dir=dest,
                token=token,
                endpoint=endpoint,
            )
            done += sibling.size or 0
            elapsed = time.monotonic() - t0
            rate = (sibling.size or 0) / elapsed / 2**20 if elapsed > 0 else 0.0
            log.info("[%d/%d] %s %s in %.1f s (%.0f MiB/s); %s of %s", i, len(wanted),
                     sibling.rfilename, _gib(sibling.size or 0), elapsed, rate, _gib(done),
                     _gib(total))  # fmt: skip
        marker = {"uri": source.uri, "commit": commit, "files": [s.rfilename for s in wanted]}
        (dest / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        log.info("%s: done in %.1f s", source.uri, time.monotonic() - started)
        return dest
    except FetchFailure:
        raise
    except Exception as e:  # every failure leaves as a classified FetchFailure
        named = os.environ.get(HF_TOKEN_SOURCE_ENV, "") or (TOKEN_ENV if token else "")
        raise classify(e, source, token_from=named) from e


def check(
    source: HubSource,
    *,
    token: str | None,
    endpoint: str | None = None,
    token_from: str = "",
    timeout_s: float = 10.0,
) -> FetchFailure | None:
    """What a pod's download would fail with, found without downloading (None: it can
    start): the repository and revision exist and the token may read ``config.json`` (a
    gated repository's listing is public; its files are not)."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url

    # token=False: send none (None would make the client look for a saved login).
    api = HfApi(endpoint=endpoint, token=token or False)
    try:
        info = api.model_info(source.repo_id, revision=source.revision, timeout=timeout_s)
        names = [s.rfilename for s in info.siblings or []]
        probe = "config.json" if "config.json" in names else (names[0] if names else None)
        if probe is not None:
            url = hf_hub_url(source.repo_id, probe, revision=info.sha, endpoint=endpoint)
            get_hf_file_metadata(url, token=token or False, timeout=timeout_s)
    except Exception as e:  # classified below; the operator turns it into a condition
        return classify(e, source, token_from=token_from)
    return None


def write_termination_message(failure: FetchFailure, path: str = TERMINATION_LOG) -> None:
    """The one-line reason the kubelet puts in the pod status (best effort: outside a pod
    the file does not exist)."""
    if not os.path.exists(path):
        return
    with contextlib.suppress(OSError):
        Path(path).write_text(str(failure)[:4000])  # the kubelet keeps at most 4096 bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", help="hf://org/name[@revision]")
    p.add_argument("--dest", required=True, type=Path, help="directory to download into")
    p.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="only the tokenizer, chat template and config (the gateway)",
    )
    p.add_argument("--termination-log", default=TERMINATION_LOG, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    for noisy in ("httpx", "httpx2", "huggingface_hub"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        source = parse_model_uri(args.uri)
    except ModelURIError as e:
        print(f"fetch-model: {e}", file=sys.stderr)
        return EXIT_PERMANENT
    if not isinstance(source, HubSource):
        print(f"fetch-model: {args.uri!r} is not an hf:// source", file=sys.stderr)
        return EXIT_PERMANENT
    token = os.environ.get(TOKEN_ENV) or None
    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        fetch(source, args.dest, tokenizer_only=args.tokenizer_only, token=token,
              endpoint=endpoint)  # fmt: skip
    except FetchFailure as failure:
        print(f"fetch-model: {failure}", file=sys.stderr)
        write_termination_message(failure, args.termination_log)
        return EXIT_PERMANENT if failure.permanent else EXIT_RETRYABLE
    return 0
