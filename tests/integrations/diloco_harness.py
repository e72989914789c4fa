"""torchft replica groups training DiLoCo with EDGC's outer sync (`edgc.integrations.torchft.DiLoCo`),
in one process: torchft_harness's lighthouse, threads, toy language and faults, with outer steps.

Faults are planned per (replica, outer step): a kill (the group dies in the outer sync's first
collective), a kill in the inner steps (``kill_inner``: between its first two), a failed all-reduce
(this replica's call raises after the collective ran). Every outer
step that is not committed is checked on the spot: the replica's error feedback must be exactly its
error feedback before the step plus the step's pseudo-gradient for every compressed matrix, and
what was sent raw must be carried into the next pseudo-gradient, bit for bit (float64).
"""

from __future__ import annotations

import functools
import threading
import time

import torch
import torch.distributed as dist
from models import TinyTransformer
from torchft.manager import Manager

from edgc import EDGCConfig, LowRankConfig
from edgc.integrations.torchft import DiLoCo
from edgc.sync.outer_sync import error_table

from .torchft_harness import FailingProcessGroup, Faults, InjectedKill, batch, initial_model, loss_of, run_groups

SYNC_EVERY = 4  # inner steps per outer step
# DiLoCo's outer learning rate with less momentum than its 0.9: at 4 inner steps per outer step the
# Nesterov 0.9 runs diverged once the budget took the rank to 2 (and ended worse uncompressed).
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.5
CONFIG = dict(
    r_max=8,
    rank_budget=4,
    window=3,
    warmup_fraction=0.0,
    min_warmup_steps=0,
    warmup_error_test=False,
    engine=LowRankConfig(min_compression_rate=1.0),
)


def train_replica(
    replica: int,
    lighthouse: str,
    outer_steps: int,
    faults: Faults,
    report: dict,
    quorum,
    start: threading.Barrier | None,
    *,
    options: dict,
) -> dict:
    """One attempt of one group, until ``outer_steps`` outer steps are committed."""
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = FailingProcessGroup(timeout=quorum.timeout)
    holder: dict = {}
    heals: list[int] = []

    def load(state: dict) -> None:
        holder["model"].load_state_dict(state["model"])
        holder["inner"].load_state_dict(state["inner"])
        heals.append(manager.current_step())

    manager = Manager(
        pg=pg,
        load_state_dict=load,
        replica_id=str(replica),
        store_addr="localhost",
        state_dict=lambda: {"model": holder["model"].state_dict(), "inner": holder["inner"].state_dict()},
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        use_async_quorum=False,
        connect_timeout=quorum.timeout,
        **quorum.manager_kwargs(),
    )
    try:
        module = initial_model(start, quorum)
        inner = torch.optim.Adam(module.parameters(), lr=3e-3)
        momentum = options.get("outer_momentum", OUTER_MOMENTUM)
        outer = torch.optim.SGD(
            module.parameters(), lr=options.get("outer_lr", OUTER_LR), momentum=momentum, nesterov=momentum > 0
        )
        holder.update(model=module, inner=inner)
        fragments = streaming_fragments(module) if options.get("streaming") else [module]
        diloco = DiLoCo(
            manager,
            fragments,
            inner,
            outer,
            options.get("sync_every", SYNC_EVERY),
            EDGCConfig(total_steps=outer_steps * len(fragments), **{**CONFIG, **options.get("edgc", {})}),
            fragment_sync_delay=options.get("delay", 0),
            power_iterations=options.get("iterations", 1),
            sync_method=options.get("sync"),
            error_feedback_decay=options.get("decay", 1.0),
        )
        if "bucket" in options:  # a two-stage sync of several buckets
            diloco.state.bucket_values = options["bucket"]
        return _train(replica, manager, pg, module, inner, diloco, outer_steps * len(fragments), faults, report, heals)
    finally:
        manager.shutdown(wait=False)
        pg.shutdown()


def streaming_fragments(module: TinyTransformer) -> list[torch.nn.Module]:
    """Two fragments that hold every parameter: the embeddings with the head, and the blocks."""
    ends = torch.nn.ModuleDict({"embed": module.embed, "head": module.head})
    ends.register_parameter("position", module.position)
    return [ends, module.blocks]


def _train(replica, manager, pg, module, inner, diloco, outer_steps, faults, report, heals) -> dict:
    state = diloco.state
    sent: dict[str, torch.Tensor] = {}
    reduce = state._reduce

    def recording_reduce(names, grads, flat):  # the pseudo-gradients as sent, before the sync replaces them
        sent.update({n: g.detach().clone() for n, g in zip(names, grads)})
        return reduce(names, grads, flat)

    state._reduce = recording_reduce
    attempt = report.setdefault("attempts", {}).setdefault(replica, [0])
    attempt[0] += 1
    if attempt[0] > 1:  # a killed group is up again, its manager heartbeating
        report["restarted"] = report.get("restarted", 0) + 1
    lines = report.setdefault("steps", {}).setdefault(replica, [])
    retries: dict[int, int] = {}
    base_lr, inner_steps = inner.param_groups[0]["lr"], outer_steps * diloco._sync_every
    with diloco:
        while manager.current_step() < outer_steps:
            # The data and the learning rate follow the run's position (outer step, inner step), so
            # that a restarted group goes on where the quorum is. The rate decays linearly to a tenth:
            # the final loss then compares between runs (a constant rate ends at a noisy point).
            position = manager.current_step() * diloco._sync_every + diloco._local_step
            for group in inner.param_groups:
                group["lr"] = base_lr * (1 - 0.9 * min(1.0, position / inner_steps))
            prepares = diloco._local_step == diloco._sync_every - 1 - diloco._delay  # this inner step starts a sync
            performs = diloco._local_step == diloco._sync_every - 1  # … this one takes the outer step
            if prepares:
                outer_step = manager.current_step()
                if outer_step == faults.wait_for_restart_at:  # the survivors let the killed group catch up
                    deadline = time.monotonic() + 60
                    while report.get("restarted", 0) < report["kills"] and time.monotonic() < deadline:
                        time.sleep(0.1)
                pg.die_next = (
                    2 if faults.take("kill_mid", replica, outer_step) else faults.take("kill", replica, outer_step)
                )
                pg.fail_next = faults.take("failed_allreduce", replica, outer_step)
                error_before = {n: e.clone() for n, e in error_table(state).items()}
                heals_before = len(heals)
                sent.clear()
            if diloco._local_step == 1 and faults.take("kill_inner", replica, manager.current_step()):
                pg.abort()  # dies between two inner steps: no collective in flight, its peers find out at the quorum
                pg.dead = True
                raise InjectedKill(
                    f"replica {replica} killed in the inner steps of outer step {manager.current_step()}"
                )
            retries[position] = retries.get(position, -1) + 1  # a replayed outer step sees new data
            loss = loss_of(module, *batch(replica, position, retry=retries[position] + 10 * (attempt[0] - 1)))
            loss.backward()
            inner.step()  # the hook prepares and takes the outer step when due
            inner.zero_grad()
            if pg.dead:
                raise InjectedKill(f"replica {replica} killed at outer step {outer_step}")
            if performs:
                record = diloco.last_outer_step
                lines.append(
                    {
                        "kind": "step",
                        "step": outer_step,
                        "committed": record["committed"],
                        "participants": manager.num_participants(),
                        "participating": manager.participating_rank() is not None,
                        "healed": any(h > 0 for h in heals[heals_before:]),
                        "rank": record["rank"],
                        "phase": record["phase"],
                        "loss": float(loss),
                    }
                )
                if not record["committed"]:
                    report.setdefault("discarded", []).append((replica, outer_step))
                    report.setdefault("conserved", []).append(
                        (replica, outer_step, *check_conserved(diloco, error_before, sent))
                    )
    module.eval()
    with torch.no_grad():
        final_loss = loss_of(module, *batch(99, 0, size=64)).item()
    return {
        "replica": replica,
        "params": torch.cat([p.detach().reshape(-1) for p in module.parameters()]),
        "global": torch.cat([t.reshape(-1) for f in diloco._fragments for t in f.original]),
        "shared": diloco.managed.shared_state_dict(),
        "loss": final_loss,
        "heals": diloco.managed.heals,
        "bytes_ratio": state.totals["bytes_sent"] / max(1, state.totals["bytes_raw"]),
        "discarded": diloco.managed.steps_discarded,
        "original": [f.state_dict() for f in diloco._fragments],
    }


def check_conserved(diloco, error_before: dict, sent: dict) -> tuple[int, int]:
    """After a discarded outer step: e = e_before + Δ for every compressed matrix (for every tensor of a
    state that keeps its input on a rollback, to the rounding of e − sent + sent), and the raw Δ
    carried; how many tensors were checked each way."""
    ranks = diloco.state.last_step_metrics["ranks"]
    compressed = 0
    for name, delta in sent.items():
        if diloco.state.rollback_keeps_input:
            expected = error_before.get(name, torch.zeros_like(delta)) + delta
            assert torch.allclose(diloco.state.error[name], expected, rtol=0, atol=1e-12), f"M of {name} lost"
            assert name not in diloco._carry
            compressed += 1
        elif ranks.get(name):
            matrix = delta.reshape(delta.shape[0], -1)
            expected = error_before.get(name, torch.zeros_like(matrix)) + matrix
            assert torch.equal(diloco.state.compressor.error[name], expected), f"error feedback of {name} lost"
            compressed += 1
        else:
            assert torch.equal(diloco._carry[name], delta), f"raw pseudo-gradient of {name} not carried"
    return compressed, len(sent) - compressed


def run_replicas(
    outer_steps: int,
    faults: Faults | None = None,
    replicas: int = 3,
    attempts: int = 3,
    tolerated_failures: int = 1,
    **options,
) -> dict:
    """Train ``replicas`` groups to ``outer_steps`` committed outer steps; a killed group restarts.
    ``options``: ``streaming`` (two fragments), ``delay``, ``sync_every``, ``iterations``,
    ``outer_lr``, ``outer_momentum``, ``decay`` (the error feedback's), ``edgc`` (`EDGCConfig` fields
    over CONFIG), ``sync`` (a registered sync method instead of EDGC)."""
    train = functools.partial(train_replica, options=options)
    return run_groups(train, outer_steps, faults, replicas, attempts, tolerated_failures)
