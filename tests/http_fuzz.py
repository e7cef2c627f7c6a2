"""Hypothesis strategies and the properties every FlowPrefill HTTP server must keep under
hostile or broken requests (used by tests/gateway/test_fuzz_http.py and
tests/prefill/server/test_fuzz_http.py).

Properties checked on every answer:

* an answer comes within ``REQUEST_TIMEOUT_S`` (no hang);
* no 5xx: everything generated here is a client's mistake or a valid request;
* a 4xx carries an OpenAI-style error body whose message names what was wrong (a field,
  or the body as a whole; not a library's bare phrase);
* the server still answers ``/health`` afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

REQUEST_TIMEOUT_S = 20.0
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Library phrases that name no field and no cause: a client cannot tell what to fix.
BARE_MESSAGES = ("Field required", "Input should be", "There was an error", "Value error")
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
CONTENT_TYPES = [
    None,
    "application/json",
    "application/json; charset=utf-8",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/octet-stream",
]


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value, with the edges parsers trip on: huge and negative integers, floats
    that JSON cannot spell (NaN, Infinity: ``json.dumps`` writes them anyway), unicode
    (surrogates excluded: they cannot be encoded), nesting."""
    leaves = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.integers(min_value=2**63 - 2, max_value=10**40)
        | st.integers(min_value=-(10**40), max_value=-1)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(st.characters(exclude_categories=["Cs"]), max_size=30)
    )
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
        ),
        max_leaves=max_leaves,
    )


def mutated(valid: dict[str, Any], extra_keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """``valid`` with some fields replaced by any JSON value, some dropped, some added
    (``extra_keys`` plus random names): mostly near-valid bodies that reach deep checks."""
    keys = sorted(valid)
    return st.builds(
        lambda changes, dropped, added: {
            **{k: v for k, v in valid.items() if k not in dropped},
            **changes,
            **added,
        },
        st.dictionaries(st.sampled_from(keys), json_values(), max_size=3),
        st.sets(st.sampled_from(keys), max_size=2),
        st.dictionaries(
            st.sampled_from(extra_keys) | st.text(max_size=8), json_values(), max_size=2
        ),
    )


def edge_values() -> st.SearchStrategy[Any]:
    """Values that are each plausible for some field and wrong (or at a limit) for most:
    what reaches the checks behind the type checks."""
    return st.one_of(
        st.sampled_from([0, -1, 1, 2, 2**31, 2**63, 2**64, 10**30, 0.5, -0.0, 1e308, True]),
        st.sampled_from(["", " ", "\u0000", "tiny", "chat", "\u202e\U0001f600", "x" * 5000]),
        st.lists(st.integers(min_value=-5, max_value=40000), max_size=20),
        st.sampled_from([[], {}, [[]], [{}], None, [{"role": "user"}], {"include_usage": True}]),
    )


def one_edge(valid: dict[str, Any], extra_keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """``valid`` with one field (its own or a known optional one) set to an edge value."""
    return st.builds(
        lambda key, value: {**valid, key: value},
        st.sampled_from(sorted(valid) + extra_keys),
        edge_values(),
    )


def header_values() -> st.SearchStrategy[str]:
    """Header values an HTTP client can send (printable latin-1), empty and long ones."""
    return st.text(
        st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
        max_size=300,
    ).map(str.strip)


@dataclass
class Call:
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:  # hypothesis prints the falsifying example
        return f"Call({self.method} {self.path} {self.headers} {self.body!r:.300})"


def encode(value: Any) -> bytes:
    return json.dumps(value).encode()


def bodies(valid: dict[str, Any], extra_keys: list[str]) -> st.SearchStrategy[bytes]:
    """Request bodies: near-valid JSON objects, any JSON, or bytes that are not JSON."""
    return st.one_of(
        one_edge(valid, extra_keys).map(encode),
        one_edge(valid, extra_keys).map(encode),  # twice: the likeliest to get far
        mutated(valid, extra_keys).map(encode),
        json_values().map(encode),
        st.binary(max_size=200),
        st.text(max_size=100).map(str.encode),
        st.sampled_from([b"", b"{", b"null", b"[]", b"{}", b'{"a":' * 5000, b"\xff\xfe"]),
    )


def send(client: httpx.Client, call: Call) -> httpx.Response:
    # latin-1 bytes: what goes on the wire for non-ASCII header values (httpx would
    # refuse to encode them as str).
    headers = {k.encode(): v.encode("latin-1") for k, v in call.headers.items()}
    return client.request(
        call.method, call.path, content=call.body, headers=headers, timeout=REQUEST_TIMEOUT_S
    )


def check_answer(client: httpx.Client, call: Call, *, expected_5xx: tuple[str, ...] = ()) -> None:
    """Send ``call`` and assert the properties in this module's docstring.

    ``expected_5xx``: error messages of 5xx answers that are the deployment's, not a bug
    (a gateway run without decode instances answers a request for more than one token
    with 503 "no decode instances").
    """
    resp = send(client, call)  # a hang is an httpx timeout: the test fails
    if resp.status_code >= 500:
        message = resp.json()["error"]["message"] if resp.content else ""
        assert any(m in message for m in expected_5xx) and expected_5xx, (
            f"{resp.status_code} for {call!r}: {resp.text[:500]}"
        )
    if 400 <= resp.status_code < 500 and call.method != "HEAD":
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"], resp.text
        assert isinstance(error["type"], str) and error["type"], resp.text
        # Says what was wrong: a field name or "request body ...", not a bare phrase.
        assert not error["message"].startswith(BARE_MESSAGES), f"{call!r}: {resp.text}"
    health = client.get("/health", timeout=REQUEST_TIMEOUT_S)
    assert health.status_code == 200, f"server unhealthy after {call!r}"
