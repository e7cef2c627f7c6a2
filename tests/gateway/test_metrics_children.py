"""``GatewayMetrics.child``: the labelled child prometheus_client would give, looked up once."""

from __future__ import annotations

from flowprefill.gateway.metrics import GatewayMetrics


def test_child_is_the_labelled_metric_and_counts_there() -> None:
    m = GatewayMetrics()
    assert m.child(m.ttft, "chat") is m.ttft.labels("chat")
    assert m.child(m.slo_requests, "chat", "met") is m.slo_requests.labels("chat", "met")
    assert m.child(m.slo_requests, "chat", "met") is not m.child(m.slo_requests, "chat", "missed")
    m.first_token("chat", ttft_s=0.1, met=True, wait_s=0.05)
    m.first_token("chat", ttft_s=0.2, met=False, wait_s=0.05)
    m.missed_at_deadline("chat")
    value = m.registry.get_sample_value
    assert (
        value("flowprefill_gateway_slo_requests_total", {"slo_class": "chat", "outcome": "met"})
        == 1
    )
    assert (
        value("flowprefill_gateway_slo_requests_total", {"slo_class": "chat", "outcome": "missed"})
        == 2
    )
    assert value("flowprefill_gateway_ttft_seconds_count", {"slo_class": "chat"}) == 2
