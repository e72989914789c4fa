"""Runs of `edgc experiment diloco`: ``replicas`` processes on gloo (127.0.0.1), each training one
model family (`diloco_families`) with DiLoCo, one arm after the other at one seed.

An arm is a dict:

* ``method``: ``"torchft"`` — torchft 0.2.0's own ``torchft.local_sgd.DiLoCo`` (its pseudo-gradients,
  its outer step), given a manager that all-reduces over the plain process group and commits every
  outer step (`PlainGroupManager`: no fault tolerance is exercised here, only the algorithm); or
  ``"edgc"`` — `edgc.integrations.diloco.DiLoCo` with ``sync`` (a registered sync method's name,
  `edgc.sync.sync_methods`) or, without it, EDGC's PowerSGD at a static ``rank`` (``edgc``: more
  `EDGCConfig` fields; no ``rank``: uncompressed);
* ``sync_every`` (H), ``inner`` (``adamw`` / ``sgd``), ``outer_lr``, ``outer_momentum``;
* ``heal``: (outer step k, policy) — replica 1's state is replaced as a torchft heal replaces it
  just after outer step k (model from θ_global, inner optimizer state from replica 0) and its error
  feedback set by ``policy`` (`edgc.sync.outer_sync.heal_error_feedback`); ``spectrum``: ranks r at which
  rank 0 reports the top-r energy share of its first pseudo-gradient and of that step's gradient;
* ``inner_lr``: the family's inner learning rate times this (default 1); ``warmup``: inner steps of a
  linear warm-up before the cosine (default none);
* ``evals``: outer steps after which the replicas validate θ_global together (each a share of the
  validation batches, the sums all-reduced): with it every outer step's training loss is the mean
  over the replicas and its H inner steps, and a run whose loss stops being finite ends there on every
  replica (``diverged_at``, the outer step; its validation loss None) instead of raising.

Rank 0 reports the validation loss after the last outer step, the bytes one replica sent, the bytes
an uncompressed all-reduce would have sent, and per outer step the sync's relative error (and, with
``evals``, ``val``: the validation loss after each of them, by outer step).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .diloco_train import arm_config, run_replicas

GRAD_CLIP = 1.0


class _AveragedWork:
    """A summing all-reduce's work that divides by the world size once waited for (torchft's AVG)."""

    def __init__(self, work, tensor: torch.Tensor, world: int):
        self.work, self.tensor, self.world = work, tensor, world

    def wait(self, timeout=None) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.tensor.div_(self.world)
        return True


class PlainGroupManager:
    """The part of ``torchft.Manager`` that torchft's DiLoCo calls, over a plain process group where
    every replica takes part in every outer step and every outer step commits."""

    _use_async_quorum = False

    def __init__(self):
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.step = 0

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _AveragedWork:
        work = dist.all_reduce(tensor, async_op=True) if self.world > 1 else None
        return _AveragedWork(work, tensor, self.world)

    def should_commit(self, timeout=None) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step

    def start_quorum(self, *args, **kwargs) -> None:
        pass

    def register_state_dict_fn(self, key, load, save) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass


def method_arm(name: str) -> dict:
    """The arm fields of a method name (see the module docstring); ValueError for an unknown one."""
    from edgc.sync.sync_methods import outer_modifiers, outer_sync_spec

    base, _, heal = name.partition("+heal=")
    kind, *modifiers = base.split("-")
    rank = re.fullmatch(r"rank(\d+)", kind)
    if kind == "torchft":
        if modifiers or heal:
            raise ValueError(f"{name!r}: torchft's DiLoCo takes no modifier")
        return {"method": "torchft"}
    arm: dict = {"method": "edgc", "rank": int(rank.group(1)) if rank else None}
    if rank or kind == "raw":
        arm.update(outer_modifiers(modifiers, name))
    else:
        arm.update(outer_sync_spec(base))
    if heal:
        arm["heal_policy"] = heal
    return arm


def train_runs(
    family: str,
    arms: list[dict],
    seed: int,
    steps: int,
    replicas: int = 2,
    timeout_s: float = 3600,
    cache_dir: str | None = None,
    size=None,
) -> list[dict]:
    """Train each of ``arms`` at ``seed`` for ``steps`` inner steps in the same ``replicas``
    processes, one after the other; rank 0's reports, each with ``cpu_s``: the CPU seconds of every
    replica's process for that arm (the first arm's with the processes' start and the family's
    build). ``size``: the family's `diloco_families.Size` (None: its standard one)."""
    return run_replicas(
        _worker,
        (family, arms, seed, steps),
        (cache_dir, size),
        replicas,
        timeout_s,
        f"diloco runs of {family} at seed {seed}",
    )


def _worker(
    rank: int,
    world: int,
    port: int,
    family_name: str,
    arms: list[dict],
    seed: int,
    steps: int,
    out: str,
    cache_dir: str | None,
    size,
) -> None:
    from .diloco_families import STANDARD, family

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        fam = family(family_name, cache_dir, size or STANDARD)
        results, cpu, began = [], [], 0.0  # the first arm's share: the process's start and the family's build too
        for arm in arms:
            results.append(train(rank, world, fam, arm, seed, steps))
            cpu.append(time.process_time() - began)
            began = time.process_time()
        cpu = torch.tensor(cpu, dtype=torch.float64)
        dist.all_reduce(cpu)  # every replica's process: what the run cost the machine's cores
        for result, seconds in zip(results, cpu.tolist()):
            result["cpu_s"] = seconds
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _build_diloco(arm: dict, model, inner, outer, outer_steps: int):
    """(DiLoCo, what reports its bytes) for the arm."""
    if arm["method"] == "torchft":
        from torchft.local_sgd import DiLoCo as TorchFTDiLoCo

        return TorchFTDiLoCo(PlainGroupManager(), [model], inner, outer, arm["sync_every"], should_quantize=False), None
    from edgc import EDGCConfig
    from edgc.integrations.diloco import DiLoCo

    config = EDGCConfig.from_dict(arm_config(arm, outer_steps))
    diloco = DiLoCo(
        None,
        [model],
        inner,
        outer,
        arm["sync_every"],
        config,
        sync_method=arm.get("sync"),
        error_feedback_decay=arm.get("decay", 1.0),
    )
    return diloco, diloco.state


def inner_lr_factor(step: int, total: int, warmup: int = 0) -> float:
    """The inner learning rate's share at inner step ``step`` of ``total``: linear from 1/warmup up to 1
    over the ``warmup`` first, then a cosine down to 0 over the rest."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train(rank: int, world: int, fam, arm: dict, seed: int, steps: int) -> dict:
    """One arm on one replica (see the module docstring)."""
    model = fam.build(seed)
    sampler = fam.sampler(rank, world, seed)
    inner = fam.inner_optimizer(model, arm["inner"], arm.get("inner_lr", 1.0))
    base = [g["lr"] for g in inner.param_groups]
    momentum = arm["outer_momentum"]
    outer = torch.optim.SGD(model.parameters(), lr=arm["outer_lr"], momentum=momentum, nesterov=momentum > 0)
    h = arm["sync_every"]
    outer_steps = steps // h
    diloco, state = _build_diloco(arm, model, inner, outer, outer_steps)
    probe = _Probe(model, arm.get("spectrum") or (), h) if rank == 0 else None
    hook = inner.register_step_post_hook(probe.after_inner_step) if probe is not None else None  # before DiLoCo's
    heal_at, policy = arm.get("heal") or (None, None)
    track = _Track(rank, world, fam, arm.get("evals") or ())
    log, start = [], time.perf_counter()
    with diloco:
        for step in range(outer_steps * h):
            for group, lr in zip(inner.param_groups, base):
                group["lr"] = lr * inner_lr_factor(step, outer_steps * h, arm.get("warmup", 0))
            loss = fam.loss(model, sampler.next_batch())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            inner.step()  # every H-th: the outer step
            inner.zero_grad(set_to_none=True)
            track.inner_step(float(loss.detach()), f"{fam.name} diverged at inner step {step} ({arm}, seed {seed})")
            if (step + 1) % h == 0:
                record = _outer_record(diloco, float(loss.detach()))
                if not track.outer_step((step + 1) // h, model, record):
                    break  # diverged, on every replica alike
                log.append(record)
                if heal_at is not None and (step + 1) // h == heal_at:
                    _heal(rank, model, inner, diloco, policy)
    if hook is not None:
        hook.remove()
    raw = sum(p.numel() * p.element_size() for p in model.parameters()) * outer_steps
    sent = state.totals["bytes_sent"] if state is not None else raw
    return {
        **track.report(model, outer_steps),
        "bytes": sent,
        "bytes_raw": raw,
        "outer_steps": outer_steps,
        "outer": log,
        "wall_s": time.perf_counter() - start,
        "spectrum": probe.spectrum if probe is not None else None,
    }


class _Track:
    """The losses of one run: without ``evals`` a non-finite loss raises and rank 0 validates once at the
    end; with them, see the module docstring."""

    def __init__(self, rank: int, world: int, fam, evals):
        self.rank, self.world, self.fam, self.evals = rank, world, fam, set(evals)
        self.losses: list[float] = []
        self.val: dict[str, float] = {}
        self.diverged_at: int | None = None

    def inner_step(self, loss: float, message: str) -> None:
        if not self.evals and not math.isfinite(loss):
            raise FloatingPointError(message)
        self.losses.append(loss)

    def outer_step(self, k: int, model, record: dict) -> bool:
        """Record outer step k; False where the run diverged (the same answer on every replica)."""
        if not self.evals:
            return True
        mean = self._all_sum([sum(self.losses), len(self.losses)])
        self.losses = []
        record["train_loss"] = mean[0] / mean[1]
        if not math.isfinite(record["train_loss"]):
            self.diverged_at = k
            return False
        if k in self.evals:
            total, count = self._all_sum(self.fam.validation_sums(model, self.rank, self.world))
            self.val[str(k)] = total / count
        return True

    def _all_sum(self, values) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(tensor)
        return tensor.tolist()

    def report(self, model, outer_steps: int) -> dict:
        if not self.evals:
            return {"val_loss": self.fam.validation_loss(model) if self.rank == 0 else None}
        final = None if self.diverged_at is not None else self.val.get(str(outer_steps))
        return {"val_loss": final, "val": self.val, "diverged_at": self.diverged_at}


def _outer_record(diloco, loss: float) -> dict:
    record = getattr(diloco, "last_outer_step", None) or {}
    return {"train_loss": loss, "relative_error": record.get("relative_error"), "bytes_sent": record.get("bytes_sent")}


@torch.no_grad()
def _heal(rank: int, model, inner, diloco, policy: str) -> None:
    """Replica 1 comes back as a torchft heal brings it: the model is θ_global (every replica holds it
    after the outer step), the inner optimizer's state is replica 0's, the error feedback per ``policy``."""
    from edgc.sync.outer_sync import heal_error_feedback

    received = [inner.state_dict()]
    if dist.is_initialized():
        dist.broadcast_object_list(received, src=0)
    if rank == 1:
        inner.load_state_dict(received[0])
    if hasattr(diloco, "state"):
        heal_error_feedback(diloco.state.error_table(), diloco.state.comm, policy, healed=rank == 1)


class _Probe:
    """Top-r energy shares of rank 0's first pseudo-gradient Δ and of its H-th inner step's gradient,
    over the matrices (energy-weighted: Σ top-r σ² / Σ ‖A‖², A viewed as PowerSGD views it)."""

    def __init__(self, model, ranks, h: int):
        self.ranks, self.h, self.steps = list(ranks), h, 0
        self.params = [p for p in model.parameters() if p.dim() >= 2]
        self.start = [p.detach().clone() for p in self.params] if self.ranks else []
        self.grads: list[torch.Tensor] = []
        self.spectrum: dict | None = None

    def after_inner_step(self, *args) -> None:
        self.steps += 1
        if self.steps != self.h or not self.ranks:
            return
        deltas = [s - p.detach() for s, p in zip(self.start, self.params)]
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        self.spectrum = {
            "pseudo_gradient": energy_shares(deltas, self.ranks),
            "gradient": energy_shares(grads, self.ranks),
        }


def energy_shares(tensors: list[torch.Tensor], ranks: list[int]) -> dict[str, float]:
    """{r: Σ over matrices of their top-r squared singular values / Σ of their squared norms}."""
    tops = {r: 0.0 for r in ranks}
    total = 0.0
    for t in tensors:
        s2 = torch.linalg.svdvals(t.reshape(t.shape[0], -1).double()).square()
        total += float(s2.sum())
        for r in ranks:
            tops[r] += float(s2[:r].sum())
    return {str(r): tops[r] / total if total > 0 else math.nan for r in ranks}
