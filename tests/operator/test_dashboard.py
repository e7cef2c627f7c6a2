"""The Grafana dashboard and the recording rules the chart ships: they parse, their PromQL
parses (promql-parser), and every metric they name is one the code exports (collected from
the gateway's and engine's registries, and the contracts' names) or a rule the rules file
records."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import promql_parser
import pytest
import yaml
from flowprefill_operator.metrics import OperatorMetrics
from prometheus_client import CollectorRegistry

import flowprefill.contracts.metrics as metric_names
from flowprefill.contracts.slo import SLOTable
from flowprefill.gateway.metrics import GatewayMetrics, export_slo_targets
from flowprefill.prefill.metrics import EngineMetrics
from tests.operator.chart import CHART, render

DASHBOARD = CHART / "files" / "grafana-dashboard.json"
RULES = CHART / "files" / "recording-rules.yaml"

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}
ANY_SUFFIX = ("", "_total", "_bucket", "_sum", "_count")


def _registry_names(registry: CollectorRegistry) -> set[str]:
    return {f.name + s for f in registry.collect() for s in SUFFIXES[f.type]}


def exported_metrics() -> set[str]:
    """Series names the processes expose: the gateway's registry as GatewayState builds it,
    a prefill engine's, the operator's, and the contracts' names of processes whose
    registry is not at hand here (any series a metric of that name could have)."""
    gateway = GatewayMetrics()
    export_slo_targets(gateway.registry, lambda: SLOTable(default_class=None, classes=[]))
    names = _registry_names(gateway.registry) | _registry_names(EngineMetrics().registry)
    names |= _registry_names(OperatorMetrics().registry)
    for value in vars(metric_names).values():
        if not (isinstance(value, str) and value.startswith("flowprefill_")):
            continue
        if not any(value + s in names for s in ANY_SUFFIX):  # no registry here says its type
            names |= {value + s for s in ANY_SUFFIX}
    return names


GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def selectors(expr: str) -> set[str]:
    """Metric names an expression selects; a Grafana query's variables are replaced first
    (durations by durations, others by a regex). Raises ValueError when it does not parse."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    expr = re.sub(r"\$\{?\w+\}?", ".*", expr)
    found: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            found.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return found


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    out = []
    for group in doc["groups"]:
        assert group["name"] and group["rules"], group
        out += group["rules"]
    return out


def panels() -> Iterator[dict[str, Any]]:
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def test_the_checker_catches_an_unknown_metric_and_bad_promql() -> None:
    assert selectors('sum(rate(flowprefill_gateway_nope_total{a="$namespace"}[5m]))') == {
        "flowprefill_gateway_nope_total"
    }
    assert "flowprefill_gateway_nope_total" not in exported_metrics()
    assert "flowprefill_gateway_ttft_seconds_total" not in exported_metrics()  # a histogram
    with pytest.raises(ValueError):
        selectors("sum(rate(flowprefill_gateway_slo_requests_total[5m])")


def test_recording_rules_parse_and_name_only_exported_metrics() -> None:
    exported = exported_metrics()
    recorded: list[str] = []
    for rule in rules():
        assert set(rule) == {"record", "expr"}, rule
        name = rule["record"]
        # level:metric:operations, the Prometheus naming convention for recorded series
        assert re.fullmatch(r"[a-z_]+:flowprefill_[a-z0-9_]+:[a-z0-9_]+", name), name
        for used in selectors(rule["expr"]):
            # A group evaluates in order: a rule reads only those recorded before it.
            assert used in exported or used in recorded, f"{name} reads unknown {used}"
        recorded.append(name)
    assert len(set(recorded)) == len(recorded)
    wanted = {
        "namespace_slo_class:flowprefill_slo_attainment:ratio_rate5m",
        "namespace_slo_class:flowprefill_slo_attainment:ratio_rate1h",
        "namespace_slo_class:flowprefill_slo_attainment_target:max",
        "namespace_slo_class:flowprefill_slo_burn_rate:ratio_rate5m",
        "namespace_slo_class:flowprefill_slo_burn_rate:ratio_rate1h",
    }
    assert wanted <= set(recorded)
    by_name = {r["record"]: r["expr"] for r in rules()}
    assert (
        metric_names.GATEWAY_SLO_ATTAINMENT_TARGET
        in by_name["namespace_slo_class:flowprefill_slo_attainment_target:max"]
    )


def test_prometheus_rule_is_the_rules_file() -> None:
    docs = render("--set", "prometheusRule.enabled=true", "--set", "prometheusRule.labels.a=b")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    assert rule["metadata"]["labels"]["a"] == "b"
    assert not [d for d in render() if d["kind"] == "PrometheusRule"]  # off by default


def test_every_dashboard_query_names_an_exported_metric_or_a_rule() -> None:
    known = exported_metrics() | {r["record"] for r in rules()}
    dashboard = json.loads(DASHBOARD.read_text())
    seen = 0
    for panel in panels():
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            used = selectors(target["expr"])
            assert used, target["expr"]
            assert used <= known, f"{panel['title']!r}: unknown {sorted(used - known)}"
            seen += 1
    assert seen >= 8
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            (metric,) = re.findall(r"label_values\((\w+)", variable["query"])
            assert metric in known


def test_dashboard_layout_rows_and_attainment_against_target() -> None:
    all_panels = list(panels())
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    top = json.loads(DASHBOARD.read_text())["panels"]
    assert top[0]["type"] == "row", "panels are grouped in rows"
    rows = [p["title"] for p in top if p["type"] == "row"]
    assert rows[0] == "SLO attainment" and len(rows) == len(set(rows))
    taken: set[tuple[int, int]] = set()
    for p in top:  # inside the 24-column grid, no two panels on the same cell
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & taken, f"{p['title']!r} overlaps another panel"
        taken |= cells
    exprs = [{t["expr"] for t in p.get("targets", [])} for p in all_panels]
    against_target = [
        e for e in exprs
        if any("flowprefill_slo_attainment:ratio_rate5m" in x for x in e)
        and any("flowprefill_slo_attainment_target" in x for x in e)
    ]  # fmt: skip
    assert against_target, "no panel shows attainment against its target"
    assert any(any("flowprefill_slo_burn_rate" in x for x in e) for e in exprs)
    assert "Autoscaler" in rows
    assert any(any("flowprefill_operator_autoscaler_" in x for x in e) for e in exprs)
