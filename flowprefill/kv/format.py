"""The KV hand-off format: one request's prompt KV cache, as one safetensors file.

Layout (format ``flowprefill-kv``, version 1)::

    tensors   k.<i>, v.<i>   i = 0 .. num_layers-1, each [num_kv_heads, num_tokens, head_dim]
                             (``HND``: Hugging Face DynamicCache order, keys *after* RoPE),
                             all of one dtype (float32 / bfloat16 / float16)
              token_ids      int64 [num_tokens], the prompt the KV belongs to
    metadata  (safetensors ``__metadata__``, str -> str) see :class:`KVHeader`

Why this shape: it is exactly what the prefill executor already holds per layer, so the
producer writes without any re-layout, and a consumer can read a single layer or a token
range of it (safetensors slices lazily) — the vLLM connector converts to its paged layout
per layer. ``token_ids`` lets the consumer prove the KV belongs to the prompt it was asked
to continue (a wrong hand-off id must never silently produce garbage). ``checksum`` is a
CRC-32 over the tensor bytes: safetensors itself detects truncation but not flipped bytes.
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from flowprefill.contracts.names import DType
from flowprefill.errors import KVFormatError, KVMismatchError, KVNotFoundError
from flowprefill.kv.validate import MAX_NUM_TOKENS, bounded_int, fingerprint_fields

FORMAT_NAME = "flowprefill-kv"
FORMAT_VERSION = 1
LAYOUT_HND = "HND"  # [num_kv_heads, num_tokens, head_dim] per layer and per k / v

DTYPES: dict[DType, torch.dtype] = {d: getattr(torch, d.value) for d in DType}
"""The torch dtype of each :class:`~flowprefill.contracts.names.DType` (torch's own name
for it): the one mapping from the contracts' dtype names to torch, for the KV format and
for loading a model alike."""
DTYPE_NAMES = {dtype: name.value for name, dtype in DTYPES.items()}

KVLayers = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ModelFingerprint:
    """The parts of a model's architecture that decide the KV cache's shape and meaning.

    It does not identify the weights (vLLM does not expose a cheap digest of them): pairing
    the prefill and decode pools on the same model path is the deployment's job, and the
    ``model_type``/``rope_theta`` fields catch the likely mistakes (another family, another
    size) before they turn into wrong tokens.
    """

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    rope_theta: float | None = None

    @classmethod
    def from_config(cls, config: Any) -> ModelFingerprint:
        """From a Hugging Face config (vLLM's ``model_config.hf_text_config`` works too)."""
        num_heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // num_heads
        rope_theta = getattr(config, "rope_theta", None)
        if rope_theta is None:  # transformers 5 keeps it in rope_parameters
            params = getattr(config, "rope_parameters", None) or {}
            rope_theta = params.get("rope_theta") if isinstance(params, Mapping) else None
        return cls(
            model_type=str(config.model_type),
            num_layers=int(config.num_hidden_layers),
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            rope_theta=float(rope_theta) if rope_theta is not None else None,
        )

    def check_matches(self, expected: ModelFingerprint) -> None:
        """Raise KVMismatchError naming the first field that differs from ``expected``."""
        for name, want in asdict(expected).items():
            got = getattr(self, name)
            if want is not None and got is not None and want != got:
                raise KVMismatchError(f"model {name}", want, got, "KV from another model")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelFingerprint:
        """Parse and bound-check (ValueError): the text may come from an untrusted file."""
        return cls(**fingerprint_fields(json.loads(text)))


@dataclass(frozen=True)
class KVHeader:
    """Everything about a hand-off except the tensors; cheap to read (no tensor data)."""

    fingerprint: ModelFingerprint
    num_tokens: int
    dtype: str
    token_ids_sha256: str
    checksum: int
    request_id: str = ""
    first_token_id: int | None = None
    created_unix_s: float = 0.0
    version: int = FORMAT_VERSION
    layout: str = LAYOUT_HND

    @property
    def num_layers(self) -> int:
        return self.fingerprint.num_layers

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT_NAME,
            "version": str(self.version),
            "layout": self.layout,
            "fingerprint": self.fingerprint.to_json(),
            "num_tokens": str(self.num_tokens),
            "dtype": self.dtype,
            "token_ids_sha256": self.token_ids_sha256,
            "checksum_crc32": str(self.checksum),
            "request_id": self.request_id,
            "first_token_id": "" if self.first_token_id is None else str(self.first_token_id),
            "created_unix_s": repr(self.created_unix_s),
        }

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str] | None, where: str) -> KVHeader:
        if not meta or meta.get("format") != FORMAT_NAME:
            raise KVFormatError(f"{where}: not a {FORMAT_NAME} file (metadata {meta!r})")
        if meta.get("version") != str(FORMAT_VERSION):
            raise KVFormatError(
                f"{where}: format version {meta.get('version')!r}, this reader knows "
                f"{FORMAT_VERSION}"
            )
        try:
            first = meta.get("first_token_id", "")
            header = cls(
                fingerprint=ModelFingerprint.from_json(meta["fingerprint"]),
                num_tokens=bounded_int("num_tokens", int(meta["num_tokens"]), MAX_NUM_TOKENS),
                dtype=meta["dtype"],
                token_ids_sha256=meta["token_ids_sha256"],
                checksum=int(meta["checksum_crc32"]),
                request_id=meta.get("request_id", ""),
                first_token_id=int(first) if first else None,
                created_unix_s=float(meta.get("created_unix_s", "0")),
                layout=meta["layout"],
            )
        except (KeyError, ValueError, TypeError, RecursionError) as exc:
            # RecursionError: deeply nested JSON in the fingerprint.
            raise KVFormatError(f"{where}: bad metadata ({exc!r:.300})") from exc
        if header.layout != LAYOUT_HND or header.dtype not in DTYPES:
            raise KVFormatError(f"{where}: unsupported layout/dtype {header.layout}/{header.dtype}")
        return header


@dataclass
class KVHandoff:
    """One request's prompt KV, in memory: ``layers[i] = (key, value)``, each [H, T, D]."""

    header: KVHeader
    token_ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def token_ids_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 of the ids as little-endian int64: the same prompt gives the same digest."""
    data = torch.tensor(list(token_ids), dtype=torch.int64).numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()


def _crc(tensors: Sequence[torch.Tensor], crc: int = 0) -> int:
    for tensor in tensors:
        crc = zlib.crc32(tensor.contiguous().view(torch.uint8).numpy().data, crc)
    return crc


def build_handoff(
    layers: KVLayers,
    token_ids: Sequence[int],
    fingerprint: ModelFingerprint,
    request_id: str = "",
    first_token_id: int | None = None,
) -> KVHandoff:
    """Validate per-layer (key, value) tensors against ``fingerprint`` and wrap them.

    Tensors must be [num_kv_heads, num_tokens, head_dim] (a leading batch dim of 1 is
    accepted and dropped) and are moved to CPU; this is the one place producer output is
    checked, so a shape bug in the executor fails here rather than inside vLLM.
    """
    ids = [int(t) for t in token_ids]
    if not ids:
        raise KVMismatchError("num_tokens", ">= 1", 0, "empty prompt")
    if len(layers) != fingerprint.num_layers:
        raise KVMismatchError("num_layers", fingerprint.num_layers, len(layers))
    want = (fingerprint.num_kv_heads, len(ids), fingerprint.head_dim)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    dtype: torch.dtype | None = None
    for index, pair in enumerate(layers):
        fixed = []
        for kind, tensor in zip(("key", "value"), pair, strict=True):
            t = tensor.detach()
            if t.dim() == 4 and t.shape[0] == 1:
                t = t[0]
            if tuple(t.shape) != want:
                raise KVMismatchError(
                    f"layer {index} {kind} shape [heads, tokens, head_dim]", want, tuple(t.shape)
                )
            if t.dtype not in DTYPE_NAMES or (dtype is not None and t.dtype != dtype):
                raise KVMismatchError(f"layer {index} {kind} dtype", dtype, t.dtype)
            dtype = t.dtype
            fixed.append(t.to("cpu").contiguous())
        out.append((fixed[0], fixed[1]))
    assert dtype is not None
    header = KVHeader(
        fingerprint=fingerprint,
        num_tokens=len(ids),
        dtype=DTYPE_NAMES[dtype],
        token_ids_sha256=token_ids_digest(ids),
        checksum=_crc([t for pair in out for t in pair]),
        request_id=request_id,
        first_token_id=first_token_id,
        created_unix_s=time.time(),
    )
    return KVHandoff(header=header, token_ids=ids, layers=out)


def write_handoff(handoff: KVHandoff, path: str | Path) -> Path:
    """Write ``handoff`` to ``path`` (the caller makes it atomic; see SharedDirTransport)."""
    tensors: dict[str, torch.Tensor] = {
        "token_ids": torch.tensor(handoff.token_ids, dtype=torch.int64)
    }
    for index, (key, value) in enumerate(handoff.layers):
        tensors[f"k.{index}"] = key
        tensors[f"v.{index}"] = value
    save_file(tensors, str(path), metadata=handoff.header.to_metadata())
    return Path(path)


class KVReader:
    """Lazy reader of one hand-off file: header first, then layers or token ranges.

    Opening validates the metadata and that every tensor has the shape and dtype the header
    promises, without reading tensor data; ``layer()`` reads only the requested range.
    Use as a context manager.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        where = str(self.path)
        if not self.path.is_file():
            raise KVNotFoundError(f"no KV hand-off at {where}")
        try:
            self._file = safe_open(where, framework="pt", device="cpu")
            self.header = KVHeader.from_metadata(self._file.metadata(), where)
            self._check_tensors(where)
        except SafetensorError as exc:
            raise KVFormatError(f"{where}: unreadable safetensors file ({exc})") from exc

    def _check_tensors(self, where: str) -> None:
        specs = {}
        names: list[str] = list(self._file.keys())  # safe_open is not iterable
        for name in names:
            sl = self._file.get_slice(name)
            specs[name] = (sl.get_dtype(), list(sl.get_shape()))
        _check_tensor_specs(self.header, specs, where)

    def token_ids(self) -> list[int]:
        ids = self._file.get_tensor("token_ids")
        if ids.shape != (self.header.num_tokens,):
            raise KVFormatError(f"{self.path}: token_ids shape {tuple(ids.shape)}")
        out = [int(t) for t in ids.tolist()]
        if token_ids_digest(out) != self.header.token_ids_sha256:
            raise KVFormatError(f"{self.path}: token_ids do not match their digest (corrupted)")
        return out

    def layer(
        self, index: int, start: int = 0, end: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) of layer ``index`` for tokens [start, end), each [H, end-start, D]."""
        stop = self.header.num_tokens if end is None else end
        if (
            not 0 <= index < self.header.num_layers
            or not 0 <= start <= stop <= self.header.num_tokens
        ):
            raise KVMismatchError(
                "layer/token range",
                f"layer < {self.header.num_layers}, tokens <= {self.header.num_tokens}",
                (index, start, stop),
            )
        key = self._file.get_slice(f"k.{index}")[:, start:stop, :]
        value = self._file.get_slice(f"v.{index}")[:, start:stop, :]
        return key, value

    def verify(self) -> None:
        """Check every byte: the token ids against their digest and the tensor data
        against its CRC-32, one layer at a time (memory: one layer). Raises
        :class:`KVFormatError` naming the file."""
        self.token_ids()
        crc = 0
        for i in range(self.header.num_layers):
            crc = _crc(self.layer(i), crc)
        if crc != self.header.checksum:
            raise KVFormatError(f"{self.path}: tensor data fails its CRC-32 (corrupted)")

    def read_all(self, verify_checksum: bool = True) -> KVHandoff:
        layers = [self.layer(i) for i in range(self.header.num_layers)]
        if verify_checksum and _crc([t for p in layers for t in p]) != self.header.checksum:
            raise KVFormatError(f"{self.path}: tensor data fails its CRC-32 (corrupted)")
        return KVHandoff(header=self.header, token_ids=self.token_ids(), layers=layers)

    def close(self) -> None:
        # safe_open has no close(); dropping the handle releases the mmap.
        self._file = None  # type: ignore[assignment]

    def __enter__(self) -> KVReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SAFETENSORS_DTYPE = {DType.FLOAT32: "F32", DType.BFLOAT16: "BF16", DType.FLOAT16: "F16"}


def _st_dtype(name: str) -> str:
    """safetensors' code for a dtype name."""
    return _SAFETENSORS_DTYPE[DType(name)]


def _check_tensor_specs(
    h: KVHeader, specs: Mapping[str, tuple[str, list[int]]], where: str
) -> None:
    """The tensors (name → safetensors dtype, shape) are exactly what ``h`` promises."""
    names = set(specs)
    # num_layers is bounded (validate.MAX_LAYERS): building every expected name is cheap.
    want = {"token_ids"} | {f"{kv}.{i}" for i in range(h.num_layers) for kv in "kv"}
    if names != want:
        missing, extra = sorted(want - names), sorted(names - want)
        raise KVFormatError(f"{where}: tensors missing {missing[:4]}, unexpected {extra[:4]}")
    ids_dtype, ids_shape = specs["token_ids"]
    if ids_dtype != "I64" or list(ids_shape) != [h.num_tokens]:
        raise KVFormatError(
            f"{where}: tensor token_ids is {ids_dtype}{list(ids_shape)}, header says "
            f"I64[{h.num_tokens}]"
        )
    shape = [h.fingerprint.num_kv_heads, h.num_tokens, h.fingerprint.head_dim]
    for name in sorted(want - {"token_ids"}):
        dtype, got = specs[name]
        if list(got) != shape or dtype != _st_dtype(h.dtype):
            raise KVFormatError(
                f"{where}: tensor {name} is {dtype}{list(got)}, header says {h.dtype}{shape}"
            )


# safetensors: 8-byte little-endian header length, then that many bytes of JSON, then data.
SAFETENSORS_PREFIX = 8
SAFETENSORS_MAX_HEADER = 100_000_000  # the limit safetensors itself enforces


def file_header_length(prefix: bytes, where: str) -> int:
    """Bytes of the whole safetensors header (the 8-byte length + JSON) from its first 8."""
    if len(prefix) < SAFETENSORS_PREFIX:
        raise KVFormatError(f"{where}: {len(prefix)} bytes, too short for a safetensors header")
    n = int.from_bytes(prefix[:SAFETENSORS_PREFIX], "little")
    if not 2 <= n <= SAFETENSORS_MAX_HEADER:
        raise KVFormatError(f"{where}: safetensors header length {n} is not plausible")
    return SAFETENSORS_PREFIX + n


def parse_file_header(raw: bytes, where: str) -> tuple[KVHeader, int]:
    """Validate a hand-off from its file's first bytes (at least the whole header) alone.

    Returns the header and the size the complete file must have. Checks the same as
    :class:`KVReader` does on open (metadata, tensor names, shapes, dtypes) — what a remote
    consumer can decide before fetching any tensor data.
    """
    end = file_header_length(raw, where)
    if len(raw) < end:
        raise KVFormatError(f"{where}: header truncated ({len(raw)} of {end} bytes)")
    try:
        obj = json.loads(raw[SAFETENSORS_PREFIX:end])
        if not isinstance(obj, dict):
            raise TypeError(f"header is a JSON {type(obj).__name__}, not an object")
        meta = obj.pop("__metadata__", None)
        if meta is not None and not (
            isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
        ):
            raise TypeError("__metadata__ must map strings to strings")
        specs: dict[str, tuple[str, list[int]]] = {}
        data_end = 0
        for name, info in obj.items():
            begin, stop = (int(x) for x in info["data_offsets"])
            if not 0 <= begin <= stop:
                raise ValueError(f"tensor {name} has data_offsets {begin}, {stop}")
            specs[name] = (str(info["dtype"]), [int(d) for d in info["shape"]])
            data_end = max(data_end, stop)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise KVFormatError(f"{where}: unreadable safetensors header ({exc!r:.300})") from exc
    header = KVHeader.from_metadata(meta, where)
    _check_tensor_specs(header, specs, where)
    return header, end + data_end


def read_header(path: str | Path) -> KVHeader:
    """Validate a hand-off file's metadata and tensor shapes without reading tensor data."""
    with KVReader(path) as reader:
        return reader.header


def read_handoff(path: str | Path, verify_checksum: bool = True) -> KVHandoff:
    """Read a whole hand-off into memory; KVFormatError if it is corrupted."""
    with KVReader(path) as reader:
        return reader.read_all(verify_checksum=verify_checksum)


def check_prompt(header: KVHeader, prompt_token_ids: Sequence[int]) -> None:
    """Raise KVMismatchError unless the KV's tokens are a prefix of ``prompt_token_ids``.

    The consumer may be asked to continue ``prompt`` or ``prompt + [first_token]``; either
    way the stored tokens must be exactly its first ``num_tokens`` tokens.
    """
    if len(prompt_token_ids) < header.num_tokens:
        raise KVMismatchError(
            "num_tokens", f"<= {len(prompt_token_ids)} (request length)", header.num_tokens
        )
    digest = token_ids_digest(prompt_token_ids[: header.num_tokens])
    if digest != header.token_ids_sha256:
        raise KVMismatchError(
            "token ids", header.token_ids_sha256[:16], digest[:16], "KV is for another prompt"
        )
