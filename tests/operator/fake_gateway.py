"""A fake gateway for operator tests: a local HTTP server serving a gateway's /metrics
whose counters the test moves, and the pod the operator's scraper finds it by."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.operator.test_operator_attainment import gateway_metrics


class FakeGateway:
    """A gateway's /metrics whose counters the test moves."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.tpot_s: dict[str, list[float]] = {}
        self.work_s: dict[str, float] = {}
        self.lock = threading.Lock()
        gateway = self

        class Metrics(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with gateway.lock:
                    body = gateway_metrics(
                        dict(gateway.counts), dict(gateway.tpot_s), work_s=dict(gateway.work_s)
                    ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, cls: str, met: int = 0, missed: int = 0, work_s: float = 0.0) -> None:
        with self.lock:
            for outcome, n in (("met", met), ("missed", missed)):
                self.counts[(cls, outcome)] = self.counts.get((cls, outcome), 0) + n
            self.work_s[cls] = self.work_s.get(cls, 0.0) + work_s

    def decode(self, cls: str, tpot_s: float, n: int) -> None:
        with self.lock:
            self.tpot_s.setdefault(cls, []).extend([tpot_s] * n)

    def pod(self, service: str) -> dict[str, Any]:
        """The gateway pod the scraper finds (labels as the operator's builders set them)."""
        labels = {
            "app.kubernetes.io/managed-by": "flowprefill-operator",
            "flowprefill.io/role": "gateway",
            "flowprefill.io/service": service,
        }
        port = self.server.server_address[1]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{service}-gateway-fake", "labels": labels},
            "spec": {
                "containers": [
                    {
                        "name": "gateway",
                        "image": "g",
                        "ports": [{"name": "http", "containerPort": port}],
                    }
                ]
            },
            "status": {"phase": "Running", "podIP": "127.0.0.1"},
        }
