"""A request's headers as a read-only mapping that answers lookups at dict speed.

Starlette's :class:`~starlette.datastructures.Headers` scans the raw header list on every
lookup (lower-casing and encoding the name each time); classifying a request looks up
about ten names, most of them absent. :class:`RequestHeaders` reads the list once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping


class RequestHeaders(Mapping[str, str]):
    """``raw`` (an ASGI scope's ``headers``: names lower-cased, as ASGI requires) as a
    case-insensitive mapping with Starlette's answers: a name sent more than once gives
    its first value, names and values are decoded as latin-1."""

    __slots__ = ("_first",)

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        first: dict[str, str] = {}
        for name, value in raw:
            key = name.decode("latin-1")
            if key not in first:
                first[key] = value.decode("latin-1")
        self._first = first

    def __getitem__(self, key: str) -> str:
        return self._first[key.lower()]

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return self._first.get(key.lower(), default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._first

    def __iter__(self) -> Iterator[str]:
        return iter(self._first)

    def __len__(self) -> int:
        return len(self._first)
