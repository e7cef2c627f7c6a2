"""Names: one parser, and every place that lists names lists the contracts' names."""

from __future__ import annotations

from typing import get_args

import pytest

from flowprefill.contracts import Batching, EngineConfig, GatewayConfig, KVTransport, Policy
from flowprefill.contracts.names import Granularity, Router
from flowprefill.errors import UnknownNameError


@pytest.mark.parametrize(
    ("enum", "spelling", "member"),
    [
        (Policy, "S_EDF", Policy.S_EDF),
        (Policy, " d-edf ", Policy.D_EDF),
        (Batching, "member_headroom", Batching.MEMBER_HEADROOM),
        (KVTransport, "shared-dir", KVTransport.SHARED_DIR),
        (KVTransport, "sharedDir", KVTransport.SHARED_DIR),  # the CRD's spelling
        (Router, "Slack_Aware", Router.SLACK_AWARE),
    ],
)
def test_one_parser_accepts_every_spelling(enum: type, spelling: str, member: object) -> None:
    assert enum.parse(spelling) is member  # type: ignore[attr-defined]


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown scheduling policy 'lifo'.*s-edf"):
        Policy.parse("lifo")
    with pytest.raises(ValueError, match="routing policy"):
        GatewayConfig(service="s", model_name="m", prefill=[], decode=[], prefill_routing="slack")


def test_configs_store_the_canonical_name() -> None:
    config = EngineConfig(policy="S_EDF", batching="SLO_AWARE", granularity="Layer")
    dumped = config.model_dump(mode="json")
    assert (dumped["policy"], dumped["batching"], dumped["granularity"]) == (
        "s-edf",
        "slo-aware",
        "layer",
    )


def test_the_crd_admits_exactly_the_engines_names() -> None:
    pytest.importorskip("kopf")
    from flowprefill_operator.models import servingpool

    assert set(get_args(servingpool.Policy)) == set(Policy.values())
    assert set(get_args(servingpool.Batching)) == set(Batching.values())
    assert set(get_args(servingpool.Granularity)) == set(Granularity.values())


def test_each_dtype_names_a_torch_dtype_of_its_itemsize() -> None:
    from flowprefill.contracts import DType
    from flowprefill.kv.format import DTYPES

    assert set(DTYPES) == set(DType)
    for dtype in DType:
        assert DTYPES[dtype].itemsize == dtype.itemsize
