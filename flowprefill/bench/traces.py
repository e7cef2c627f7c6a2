"""Trace files for replay: JSONL (QwenTrace-style) and CSV (Azure LLM-inference-style).

* JSONL — one object per line: ``timestamp`` (seconds, or an ISO-8601 string),
  ``input_length`` (prompt tokens), ``output_length`` (ignored: prefill only) and ``type``
  (``text``/``image``/``search``/``file``; optional).
* CSV — header ``TIMESTAMP,ContextTokens,GeneratedTokens``; ``TIMESTAMP`` is seconds or a
  date-time such as ``2023-11-16 18:15:46.6805900``.

Rows without a type get one by **prompt length**: the most likely Table 1 type under the
fitted length distributions of :mod:`.workload` (image folded into text, their lengths
being alike): ``< 2512`` tokens → text, ``< 19880`` → search, otherwise file.

Any malformed row is rejected with an error naming the file and the line.
"""

from __future__ import annotations

import csv
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from flowprefill.bench.workload import Workload, from_rows
from flowprefill.errors import InvalidRequestError

SEARCH_FROM_TOKENS = 2512
FILE_FROM_TOKENS = 19880
CSV_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def type_by_length(num_tokens: int) -> str:
    if num_tokens < SEARCH_FROM_TOKENS:
        return "text"
    if num_tokens < FILE_FROM_TOKENS:
        return "search"
    return "file"


def _where(path: Path, line: int) -> str:
    return f"{path.name} line {line}"


def _timestamp(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise InvalidRequestError(f"{where}: timestamp {value!r} is not a time")
    if isinstance(value, int | float):
        t = float(value)
    elif isinstance(value, str):
        try:
            t = float(value)
        except ValueError:
            try:
                t = datetime.fromisoformat(value.strip()).timestamp()
            except ValueError:
                raise InvalidRequestError(
                    f"{where}: timestamp {value!r} is neither seconds nor an ISO date-time"
                ) from None
    else:
        raise InvalidRequestError(f"{where}: timestamp {value!r} is not a time")
    if not math.isfinite(t) or t < 0:
        raise InvalidRequestError(f"{where}: timestamp {value!r} must be finite and ≥ 0")
    return t


def _tokens(
    value: Any, field: str, where: str, max_tokens: int, *, allow_zero: bool = False
) -> int:
    if isinstance(value, bool):
        raise InvalidRequestError(f"{where}: {field} {value!r} is not a token count")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{where}: {field} {value!r} is not a token count") from None
    if not (math.isfinite(f) and f == int(f) and (f > 0 or (allow_zero and f == 0))):
        kind = "a non-negative" if allow_zero else "a positive"
        raise InvalidRequestError(f"{where}: {field} must be {kind} integer, got {value!r}")
    n = int(f)
    if n > max_tokens:
        raise InvalidRequestError(
            f"{where}: {field} {n} exceeds the model's context of {max_tokens} tokens"
        )
    return n


def load_trace(path: str | Path, slo_table: dict[str, float], *, max_tokens: int) -> Workload:
    """Read a ``.jsonl`` or ``.csv`` trace; the suffix picks the format."""
    p = Path(path)
    if not p.is_file():
        raise InvalidRequestError(f"--trace {p}: no such file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        times, tokens, classes = _read_jsonl(p, slo_table, max_tokens)
    elif suffix == ".csv":
        times, tokens, classes = _read_csv(p, max_tokens)
    else:
        raise InvalidRequestError(f"--trace {p}: expected a .jsonl or .csv file")
    if not times:
        raise InvalidRequestError(f"--trace {p}: the trace has no requests")
    return from_rows(f"trace:{p.name}", times, tokens, classes, slo_table)


def _read_jsonl(
    p: Path, slo_table: dict[str, float], max_tokens: int
) -> tuple[list[float], list[int], list[str]]:
    times: list[float] = []
    tokens: list[int] = []
    classes: list[str] = []
    with p.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = _where(p, line_no)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise InvalidRequestError(f"{where}: expected a JSON object")
            for key in ("timestamp", "input_length"):
                if key not in row:
                    raise InvalidRequestError(f"{where}: missing field {key!r}")
            times.append(_timestamp(row["timestamp"], where))
            n = _tokens(row["input_length"], "input_length", where, max_tokens)
            if "output_length" in row:
                _tokens(row["output_length"], "output_length", where, 1 << 31, allow_zero=True)
            kind = row.get("type")
            if kind is None:
                kind = type_by_length(n)
            elif not isinstance(kind, str) or kind not in slo_table:
                raise InvalidRequestError(
                    f"{where}: unknown type {kind!r}; expected one of {', '.join(slo_table)}"
                )
            tokens.append(n)
            classes.append(kind)
    return times, tokens, classes


def _read_csv(p: Path, max_tokens: int) -> tuple[list[float], list[int], list[str]]:
    times: list[float] = []
    tokens: list[int] = []
    classes: list[str] = []
    with p.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header[:3]) != CSV_COLUMNS:
            raise InvalidRequestError(
                f"{_where(p, 1)}: expected the header {','.join(CSV_COLUMNS)}, got {header!r}"
            )
        for row in reader:
            where = _where(p, reader.line_num)
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) < 3:
                raise InvalidRequestError(f"{where}: expected 3 columns, got {len(row)}")
            times.append(_timestamp(row[0], where))
            n = _tokens(row[1].strip(), "ContextTokens", where, max_tokens)
            _tokens(row[2].strip(), "GeneratedTokens", where, 1 << 31, allow_zero=True)
            tokens.append(n)
            classes.append(type_by_length(n))
    return times, tokens, classes
