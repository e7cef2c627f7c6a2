"""Overload end to end: a tiny stack at 1x, 2x and 3x its capacity (issue 23 item 4).

    python benchmarks/stack/overload.py [--loads 1,2,3] [--duration 20] [--tokens 1024]
        [--max-waiting 64] [--out /tmp/overload]

Starts ``flowprefill up --model tiny-llama --decode 0`` with two classes: ``interactive``
(priority 10, not sheddable) and ``batch`` (priority -5, sheddable, sent with
``x-task: batch``). Capacity is measured first (:func:`saturation_rps`): first tokens
per second while the stack is offered more than it serves. Then each load offers
``load x capacity`` requests per second (Poisson arrivals, half of each class; the table
shows the rate the client managed to send) for ``--duration`` seconds, every request a
``--tokens`` prompt with ``max_tokens 1``, and waits for every answer. Per load it
prints: goodput per class
(first tokens within the class's TTFT target per second, as the gateway counts them),
429s (shed), 503s by reason (too_late, expired, queue_full), other failures, the most
requests waiting at the gateway and at the prefill instance (their metrics, sampled),
the largest RSS of the gateway and prefill processes, and whether every count at the
client equals the gateway's counters (200: ``flowprefill_gateway_ttft_seconds_count``;
429: ``..._shed_total``; 503: ``..._overload_refused_total`` by reason). The rule
behind the 503s: docs/gateway.md, "Overload". ``tests/stack/test_overload.py`` runs
:func:`offer` at 3x for CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks.stack.common import Server, scrape  # noqa: E402

INTERACTIVE, BATCH = "interactive", "batch"
REASONS = ("too_late", "expired", "queue_full")
VOCAB = 2000
"""Random prompt token ids stay below this: tiny-llama's vocabulary is 2,048."""


def slo_table(interactive_s: float, batch_s: float) -> dict[str, Any]:
    """The SLO table of the run: one class never shed, one sheddable."""

    def cls(name: str, slo_s: float, priority: int, **extra: Any) -> dict[str, Any]:
        return {"name": name, "task_type": "text", "ttft_slo_ms": round(slo_s * 1e3),
                "priority": priority, "attainment_target": 0.9, **extra}  # fmt: skip

    return {
        "version": 1,
        "default_class": INTERACTIVE,
        "classes": [
            cls(INTERACTIVE, interactive_s, 10),
            cls(BATCH, batch_s, -5, match={"headers": {"x-task": BATCH}}),
        ],
    }


@dataclass
class Result:
    """One load's answers, as the client saw them, and the gateway's counters."""

    offered_rps: float
    duration_s: float
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    """(class, HTTP status) -> answers; status 0: no answer (timeout, connection error)."""
    good: Counter[str] = field(default_factory=Counter)
    """Class -> answers within its TTFT target, timed by the client (its own event loop
    lag included: on a loaded 2-core machine it adds to every request)."""
    reasons: Counter[str] = field(default_factory=Counter)
    """503 reason (from the error body) -> answers."""
    missing_retry_after: int = 0
    elapsed_s: float = 0.0
    """First request sent to last answer received."""
    failures: Counter[str] = field(default_factory=Counter)
    """Exception name -> requests the client got no HTTP answer to."""
    gateway: dict[str, float] = field(default_factory=dict)
    """Gateway counter deltas over the load: 200, 429, each 503 reason, and ``met:<class>``
    (first token within the class's target, timed from the gateway's arrival)."""
    max_waiting_gateway: float = 0.0
    max_queue_prefill: float = 0.0
    rss_mib: dict[str, float] = field(default_factory=dict)

    def count(self, status: int, cls: str | None = None) -> int:
        return sum(n for (c, s), n in self.statuses.items() if s == status and cls in (None, c))

    @property
    def client(self) -> dict[str, float]:
        out: dict[str, float] = {"200": self.count(200), "429": self.count(429)}
        return out | {r: self.reasons[r] for r in REASONS}

    @property
    def counts_match(self) -> bool:
        return self.client == {k: self.gateway.get(k, 0.0) for k in self.client}

    def met_rps(self, cls: str) -> float:
        """Goodput of ``cls`` as the gateway counts it (met its target), per second of
        the load (first request sent to last answer)."""
        return self.gateway.get(f"met:{cls}", 0.0) / self.elapsed_s

    @property
    def unanswered(self) -> int:
        return sum(n for (_, s), n in self.statuses.items() if s not in (200, 429, 503))


def gateway_counts(url: str) -> dict[str, float]:
    """The gateway's counters the client's counts are checked against, and the requests
    of each class that met their TTFT target (``met:<class>``)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    out = {"200": 0.0, "429": 0.0} | dict.fromkeys(REASONS, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "flowprefill_gateway_ttft_seconds_count":
                out["200"] += s.value
            elif s.name == "flowprefill_gateway_shed_total":
                out["429"] += s.value
            elif s.name == "flowprefill_gateway_overload_refused_total":
                out[s.labels["reason"]] = out.get(s.labels["reason"], 0.0) + s.value
            elif s.name == "flowprefill_gateway_slo_requests_total" and (
                s.labels["outcome"] == "met"
            ):
                key = f"met:{s.labels['slo_class']}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def model_id(url: str) -> str:
    """The model name the gateway serves (``up`` names it by its directory)."""
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


class Bodies:
    """Request bodies of random ``tokens``-token prompts, serialized once and reused in
    turn: building a prompt per request would make the client, not the stack, the limit
    on a loaded 2-core machine."""

    def __init__(self, model: str, tokens: int, n: int = 256, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.bodies = [
            json.dumps({"model": model, "max_tokens": 1,
                        "prompt": [rng.randrange(1, VOCAB) for _ in range(tokens)]}).encode()
            for _ in range(n)
        ]  # fmt: skip
        self.turn = 0

    def next(self) -> bytes:
        self.turn += 1
        return self.bodies[self.turn % len(self.bodies)]


JSON = {"content-type": "application/json"}


async def _one(
    client: httpx.AsyncClient, url: str, body: bytes, cls: str, slo_s: float, res: Result
) -> None:
    headers = JSON | {"x-task": BATCH} if cls == BATCH else JSON
    t0 = time.perf_counter()
    try:
        r = await client.post(f"{url}/v1/completions", content=body, headers=headers)
    except httpx.HTTPError as e:
        res.statuses[cls, 0] += 1
        res.failures[type(e).__name__] += 1
        return
    res.statuses[cls, r.status_code] += 1
    if r.status_code == 200 and time.perf_counter() - t0 <= slo_s:
        res.good[cls] += 1
    if r.status_code in (429, 503) and "retry-after" not in r.headers:
        res.missing_retry_after += 1
    if r.status_code == 503:
        res.reasons[next((x for x in REASONS if f"({x})" in r.text), "other")] += 1


class Sampler:
    """Polls the gateway's and prefill's queue gauges and the processes' RSS."""

    def __init__(self, server: Server, period_s: float = 0.25) -> None:
        self.server, self.period_s = server, period_s
        self.waiting = self.queue = 0.0
        self.rss: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        from benchmarks.stack.common import role_of

        urls = self.server.metrics_urls
        while not self._stop.wait(self.period_s):
            g, p = scrape(urls["gateway"]), scrape(urls["prefill"])
            self.waiting = max(self.waiting, g.get("flowprefill_gateway_waiting_requests", 0))
            self.queue = max(self.queue, p.get("flowprefill_prefill_queue_depth", 0))
            assert self.server.proc is not None
            for proc in psutil.Process(self.server.proc.pid).children(recursive=True):
                try:
                    role = role_of(" ".join(proc.cmdline()))
                    mib = proc.memory_info().rss / 2**20
                except psutil.NoSuchProcess:
                    continue
                self.rss[role] = max(self.rss.get(role, 0.0), mib)


async def capacity_rps(url: str, *, tokens: int, concurrency: int, duration_s: float) -> float:
    """Completions per second with ``concurrency`` interactive requests always in flight."""
    done = 0
    bodies = Bodies(model_id(url), tokens, seed=1)
    stop = time.perf_counter() + duration_s
    async with httpx.AsyncClient(timeout=120) as client:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                r = await client.post(f"{url}/v1/completions", content=bodies.next(), headers=JSON)
                done += r.status_code == 200

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if done == 0:
            raise RuntimeError(f"no request to {url} succeeded: no capacity to measure")
        return done / (time.perf_counter() - t0)


def saturation_rps(server: Server, *, tokens: int, slo_s: dict[str, float], duration_s: float,
                   concurrency: int = 4) -> float:  # fmt: skip
    """The stack's capacity: first tokens per second while it is offered more than it can
    serve. A closed loop of ``concurrency`` requests gives a first guess (low: the engine
    batches less with few waiting); three times that is then offered with the run's class
    mix, and what was served is the capacity."""
    guess = asyncio.run(
        capacity_rps(server.base_url, tokens=tokens, concurrency=concurrency,
                     duration_s=duration_s / 2)
    )  # fmt: skip
    probe = asyncio.run(offer(server, 3 * guess, duration_s=duration_s, tokens=tokens,
                              slo_s=slo_s, seed=99))  # fmt: skip
    return probe.count(200) / probe.elapsed_s


async def offer(
    server: Server, rps: float, *, duration_s: float, tokens: int, slo_s: dict[str, float],
    seed: int = 0, timeout_s: float = 120.0,
) -> Result:  # fmt: skip
    """Offer ``rps`` (Poisson, half of each class) for ``duration_s``; wait for every answer."""
    rng = random.Random(seed)
    res = Result(rps, duration_s)
    bodies = Bodies(model_id(server.base_url), tokens, seed=seed)
    before = gateway_counts(server.base_url)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    with Sampler(server) as sampler:
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            tasks = []
            start = time.perf_counter()
            at = 0.0
            while at < duration_s:
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                cls = BATCH if rng.random() < 0.5 else INTERACTIVE
                one = _one(client, server.base_url, bodies.next(), cls, slo_s[cls], res)
                tasks.append(asyncio.create_task(one))
                at += rng.expovariate(rps)
            # What was offered: a client short of CPU sends fewer than asked.
            res.offered_rps = len(tasks) / max(duration_s, time.perf_counter() - start)
            await asyncio.gather(*tasks)
            res.elapsed_s = time.perf_counter() - start
        time.sleep(2 * sampler.period_s)  # the last gauges
    after = gateway_counts(server.base_url)
    res.gateway = {k: after[k] - before.get(k, 0.0) for k in after}
    res.max_waiting_gateway, res.max_queue_prefill = sampler.waiting, sampler.queue
    res.rss_mib = {k: round(v, 1) for k, v in sampler.rss.items()}
    return res


def start_stack(out: Path, *, max_waiting: int, slo_s: dict[str, float], profile: Path) -> Server:
    from benchmarks.stack.common import up_server, wait_all
    from flowprefill.models import named_model_dir

    out.mkdir(parents=True, exist_ok=True)
    table = out / "slo-table.json"
    table.write_text(json.dumps(slo_table(slo_s[INTERACTIVE], slo_s[BATCH])))
    model = named_model_dir("tiny-llama")
    extra = ["--decode", "0", "--slo-table", str(table), "--max-waiting", str(max_waiting),
             "OMP_NUM_THREADS=1"]  # fmt: skip
    server = up_server("overload", model, profile, out, extra)
    if not profile.exists():  # up profiles this machine once into its run folder
        at = server.cmd.index("--profile")
        del server.cmd[at : at + 2]
    server.start()
    try:
        wait_all([server], timeout_s=600)
    except BaseException:
        server.stop()
        raise
    return server


COLUMNS = (
    "load", "offered req/s", "interactive goodput req/s (200s)", "batch goodput req/s (200s)",
    "429", "503 too_late / expired / queue_full", "unanswered", "max waiting gateway / prefill",
    "max RSS MiB gateway / prefill", "client = gateway",
)  # fmt: skip


def table_rows(load: float, r: Result) -> list[str]:
    """One row of :data:`COLUMNS`; goodput as the gateway counts it (met its target)."""
    return [
        f"{load:g}x", f"{r.offered_rps:.1f}",
        f"{r.met_rps(INTERACTIVE):.1f} ({r.count(200, INTERACTIVE)})",
        f"{r.met_rps(BATCH):.1f} ({r.count(200, BATCH)})",
        str(r.count(429)), " / ".join(str(r.reasons[x]) for x in REASONS),
        f"{r.unanswered} {dict(r.failures) or ''}",
        f"{r.max_waiting_gateway:.0f} / {r.max_queue_prefill:.0f}",
        f"{r.rss_mib.get('gateway', 0):.0f} / {r.rss_mib.get('prefill', 0):.0f}",
        "yes" if r.counts_match and not r.missing_retry_after else f"NO {r.client} {r.gateway}",
    ]  # fmt: skip


def _stop_on_sigterm() -> None:
    """Turn SIGTERM (a ``timeout``) into an exception, so the stack is stopped too."""
    import signal

    def handler(signum: int, _: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--loads", default="1,2,3")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per load")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--max-waiting", type=int, default=64)
    ap.add_argument("--slo-interactive", type=float, default=0.5, help="TTFT target (s)")
    ap.add_argument("--slo-batch", type=float, default=1.0, help="TTFT target (s)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/flowprefill-overload"))
    args = ap.parse_args()
    _stop_on_sigterm()
    from rich.console import Console
    from rich.table import Table

    slo_s = {INTERACTIVE: args.slo_interactive, BATCH: args.slo_batch}
    profile = args.out / "overload-run" / "ttft-profile.json"
    server = start_stack(args.out, max_waiting=args.max_waiting, slo_s=slo_s, profile=profile)
    console = Console(width=200)
    try:
        cap = saturation_rps(server, tokens=args.tokens, slo_s=slo_s, duration_s=args.duration / 2)
        console.print(f"capacity {cap:.1f} req/s")
        table = Table(title=f"Overload: tiny-llama, {args.tokens}-token prompts, capacity "
                      f"{cap:.1f} req/s, max_waiting {args.max_waiting}, SLO interactive "
                      f"{args.slo_interactive} s / batch {args.slo_batch} s")  # fmt: skip
        for col in COLUMNS:
            table.add_column(col, justify="right")
        for load in (float(x) for x in args.loads.split(",")):
            r = asyncio.run(offer(server, load * cap, duration_s=args.duration,
                                  tokens=args.tokens, slo_s=slo_s))  # fmt: skip
            row = table_rows(load, r)
            table.add_row(*row)
            # As it is measured: a long run that is stopped still leaves its rows.
            console.print(" | ".join(f"{c}: {v}" for c, v in zip(COLUMNS, row, strict=True)))
        console.print(table)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
