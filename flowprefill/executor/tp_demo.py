"""Two-process CPU demonstration (gloo) that TP ranks park at the same checkpoint.

A tiny tensor-parallel decoder stack (Megatron style: column-parallel ``qkv_proj`` and
``gate_up_proj``, row-parallel ``o_proj`` and ``down_proj`` each followed by an all-reduce)
gets operator checkpoints from :func:`install_checkpoints` (its module names match the
name-based fallback) with :func:`tp_checkpoint` as the hook body.

Rank 0 plays the scheduler and broadcasts commands to rank 1 over the default group, as a
TP engine's driver would. Scenario: solo runs of tasks A, B, C; then A is preempted at a
random moment, B is submitted and preempted, C runs to completion, B resumes and finishes,
A resumes and finishes. Checked: every output is bit-identical to its solo run, both ranks
parked at the same checkpoint numbers, and the TP result matches the unsharded stack.

    python -m flowprefill.executor.tp_demo
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from flowprefill.errors import TaskCancelledError
from flowprefill.executor.checkpoints import install_checkpoints
from flowprefill.executor.preemption import TaskControl
from flowprefill.executor.tp import TPTaskControl, activate_tp, current_group, tp_checkpoint

HIDDEN, HEADS, INTERMEDIATE, LAYERS, TOKENS = 128, 8, 512, 4, 192
TASKS = {"A": 1, "B": 2, "C": 3}  # task → input seed


class ColumnParallel(nn.Linear):
    """Holds a slice of the output features; no communication."""


class RowParallel(nn.Linear):
    """Holds a slice of the input features; all-reduces the partial sums (world > 1)."""

    def __init__(self, in_features: int, out_features: int, world: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.world = world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.world > 1:
            dist.all_reduce(out, group=current_group())
        return out


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, world: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.qkv_proj = ColumnParallel(HIDDEN, 3 * num_heads * head_dim, bias=False)
        self.o_proj = RowParallel(num_heads * head_dim, HIDDEN, world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


class MLP(nn.Module):
    def __init__(self, intermediate: int, world: int) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallel(HIDDEN, 2 * intermediate, bias=False)
        self.down_proj = RowParallel(intermediate, HIDDEN, world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, world: int) -> None:
        super().__init__()
        self.self_attn = Attention(HEADS // world, HIDDEN // HEADS, world)
        self.mlp = MLP(INTERMEDIATE // world, world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(F.rms_norm(x, (HIDDEN,)))
        return x + self.mlp(F.rms_norm(x, (HIDDEN,)))


class TPStack(nn.Module):
    """Rank ``rank`` of ``world`` holds heads and intermediate columns ``rank/world``."""

    def __init__(self, rank: int = 0, world: int = 1, seed: int = 0) -> None:
        super().__init__()
        self.config = {"model_type": "tp-demo"}
        heads, inter = HEADS // world, INTERMEDIATE // world
        self.layers = nn.ModuleList([Layer(world) for _ in range(LAYERS)])
        gen = torch.Generator().manual_seed(seed)
        head_dim = HIDDEN // HEADS
        for layer in self.layers:
            assert isinstance(layer, Layer)
            # Full weights drawn identically on every rank, then sliced to this shard.
            qkv = torch.randn(3, HEADS, head_dim, HIDDEN, generator=gen) / math.sqrt(HIDDEN)
            o = torch.randn(HIDDEN, HEADS * head_dim, generator=gen) / math.sqrt(HIDDEN)
            gate_up = torch.randn(2, INTERMEDIATE, HIDDEN, generator=gen) / math.sqrt(HIDDEN)
            down = torch.randn(HIDDEN, INTERMEDIATE, generator=gen) / math.sqrt(INTERMEDIATE)
            h0, i0 = rank * heads, rank * inter
            layer.self_attn.qkv_proj.weight.data = qkv[:, h0 : h0 + heads].reshape(-1, HIDDEN)
            layer.self_attn.o_proj.weight.data = o[:, h0 * head_dim : (h0 + heads) * head_dim]
            layer.mlp.gate_up_proj.weight.data = gate_up[:, i0 : i0 + inter].reshape(-1, HIDDEN)
            layer.mlp.down_proj.weight.data = down[:, i0 : i0 + inter].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def task_input(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(TASKS[name])
    return torch.randn(1, TOKENS, HIDDEN, generator=gen)


class RankRunner:
    """Runs tasks on threads of one rank, each with its own TP control and group."""

    def __init__(self, model: TPStack, groups: dict[str, Any]) -> None:
        self.model, self.groups = model, groups
        self.threads: dict[str, threading.Thread] = {}
        self.controls: dict[str, TaskControl] = {}
        self.tp_controls: dict[str, TPTaskControl] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.errors: dict[str, str] = {}

    def submit(self, key: str, name: str, group_name: str) -> TaskControl:
        control = TaskControl(key)
        tp_control = TPTaskControl(control, self.groups[group_name])
        self.controls[key], self.tp_controls[key] = control, tp_control

        def main() -> None:
            try:
                with activate_tp(tp_control), torch.inference_mode():
                    self.outputs[key] = self.model(task_input(name))
            except TaskCancelledError as err:
                self.errors[key] = type(err).__name__
            finally:
                control.mark_done()

        self.threads[key] = threading.Thread(target=main, name=key, daemon=True)
        self.threads[key].start()
        return control

    def join(self, key: str) -> None:
        self.threads[key].join(120)
        assert not self.threads[key].is_alive(), f"{key} did not finish"


def _preempt_when(control: TaskControl, min_checkpoints: int, rng: random.Random) -> bool:
    while control.num_checkpoints < min_checkpoints and not control.done:
        time.sleep(0.0005)
    time.sleep(rng.uniform(0, 0.003))  # a random moment, racing the task
    parked, _ = control.request_preempt(timeout_s=60)
    return parked


def _worker(rank: int, world: int, port: int, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),  # must exceed the longest park
    )
    groups = {g: dist.new_group(list(range(world)), backend="gloo") for g in ("g1", "g2", "g3")}
    model = TPStack(rank, world, seed=0)
    handle = install_checkpoints(model, "operator", on_boundary=tp_checkpoint)
    runner = RankRunner(model, groups)
    per_forward = handle.num_checkpoints_per_forward

    def command(*cmd: Any) -> tuple[Any, ...]:
        box = [cmd if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return tuple(box[0])  # type: ignore[arg-type]

    def submit(key: str, name: str, group: str) -> TaskControl:
        command("submit", key, name, group)
        return runner.submit(key, name, group)

    if rank == 0:
        rng = random.Random(0)
        for name in TASKS:  # solo runs, one after another
            submit(f"solo-{name}", name, "g1")
            runner.join(f"solo-{name}")
        a = submit("A", "A", "g1")
        parked_a = _preempt_when(a, per_forward // 4, rng)
        b = submit("B", "B", "g2")
        parked_b = _preempt_when(b, per_forward // 2, rng)
        submit("C", "C", "g3")
        runner.join("C")
        b.resume() if parked_b else None
        runner.join("B")
        a.resume() if parked_a else None
        runner.join("A")
        d = submit("D", "A", "g1")  # preempted, then cancelled: both ranks must stop
        parked_d = _preempt_when(d, per_forward // 2, rng)
        d.cancel()
        runner.join("D")
        command("done")
    else:
        while True:
            cmd = command()
            if cmd[0] == "done":
                break
            runner.submit(*cmd[1:])
    for key in runner.threads:
        runner.join(key)
    report = {
        "rank": rank,
        "parked_at": {k: c.parked_at for k, c in runner.tp_controls.items()},
        "num_checkpoints": {k: c.num_checkpoints for k, c in runner.controls.items()},
        "per_forward": per_forward,
        "errors": runner.errors,
    }
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        reference = TPStack(0, 1, seed=0)  # unsharded, no communication
        with torch.inference_mode():
            ref = {name: reference(task_input(name)) for name in TASKS}
        result = {
            "reports": reports,
            "bit_identical": {
                n: torch.equal(runner.outputs[n], runner.outputs[f"solo-{n}"]) for n in TASKS
            },
            "max_abs_diff_vs_unsharded": {
                n: float((runner.outputs[n] - ref[n]).abs().max()) for n in TASKS
            },
            "preempted": {"A": bool(parked_a), "B": bool(parked_b), "D": bool(parked_d)},
        }
        with open(result_path, "w") as out:
            json.dump(result, out, indent=2)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_demo(world: int = 2) -> dict[str, Any]:
    """Spawn ``world`` CPU processes, run the scenario, return rank 0's findings."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.start_processes(
            _worker, args=(world, _free_port(), path), nprocs=world, start_method="spawn"
        )
        with open(path) as result:
            return dict(json.load(result))


if __name__ == "__main__":
    print(json.dumps(run_demo(), indent=2))
