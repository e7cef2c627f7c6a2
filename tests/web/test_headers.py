"""``RequestHeaders`` answers every lookup as Starlette's ``Headers`` does for the same
ASGI header list: case-insensitive names, the first of repeated names, latin-1, absent
names None (or the default)."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from flowprefill.web.headers import RequestHeaders

RAW = [
    (b"host", b"gw:8000"),
    (b"x-slo-class", b"batch"),
    (b"x-slo-class", b"chat"),  # repeated: the first wins
    (b"authorization", b"Bearer sk-1"),
    (b"x-latin", "caf\u00e9".encode("latin-1")),
    (b"x-empty", b""),
]
NAMES = ["host", "HOST", "X-Slo-Class", "x-slo-class", "Authorization", "x-latin", "x-empty",
         "x-missing", ""]  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_lookups_answer_as_starlettes(name: str) -> None:
    ours, theirs = RequestHeaders(RAW), Headers(raw=RAW)
    assert ours.get(name) == theirs.get(name)
    assert ours.get(name, "default") == theirs.get(name, "default")
    assert (name in ours) == (name in theirs)
    if name in theirs:
        assert ours[name] == theirs[name]
    else:
        with pytest.raises(KeyError):
            ours[name]


def test_the_distinct_names_in_order() -> None:
    h = RequestHeaders(RAW)
    assert list(h) == ["host", "x-slo-class", "authorization", "x-latin", "x-empty"]
    assert len(h) == 5 and dict(h)["x-slo-class"] == "batch"
    assert 3 not in h
