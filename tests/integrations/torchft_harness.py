"""Replica groups of torchft in one process, shaped like torchft's manager_integ_test: a lighthouse
in-process, one thread per replica group (one rank each), a runner that restarts a killed group.

Each replica trains EDGC (`edgc.integrations.torchft`) on a learnable toy language (a token is
followed by a fixed permutation of itself, or by a random token one time in five: an entropy
floor of about 1.3 nats, so final losses compare like those of real data), float64 so that error feedback can be
checked to
the last bit. Faults are planned per (replica, step): a kill at the start of the step, a failed
all-reduce (the collective runs, then this replica's call raises, as a local
error would; torchft 0.2's FakeProcessGroupWrapper's error never reaches its manager), a NaN gradient,
a stall (the step lasts one TIMEOUT, as for a survivor left waiting on a peer that dropped the
collective; it waits at the step's end, after its commit, so that its peers wait for it in the next
quorum, never inside a collective, whose timeout is TIMEOUT too). Every uncommitted step is checked on the spot: the
replica's error feedback must be exactly its error feedback before the
step plus the step's gradient (or zero when that gradient was not finite).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from models import TinyTransformer
from torch import nn
from torchft._torchft import LighthouseServer
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from edgc import EDGCConfig, LowRankConfig
from edgc.integrations.torchft import DistributedDataParallel
from edgc.integrations.torchft_quorum import QuorumSettings
from edgc_probes.stream_check import StreamChecker

VOCAB, SEQ, NOISE = 64, 16, 0.2
CONFIG = dict(
    r_max=8,
    r_min=2,
    rank_step=2,
    window=3,
    warmup_fraction=0.1,
    warmup_error_test=False,
    iteration_sample_ratio=1.0,
    gradient_sample_ratio=0.5,
    entropy_estimator="gaussian",
    entropy_significance=0.0,
    engine=LowRankConfig(min_compression_rate=1.0),
)
TIMEOUT = timedelta(seconds=5)  # process group and manager calls


def quorum_settings(replicas: int, tolerated_failures: int) -> QuorumSettings:
    """`edgc bench --torchft`'s quorum settings at this harness's TIMEOUT. Only the quorum timeout
    is longer (it decides no membership): a restarted group on a starved 2-core machine once
    needed more than 60 s to join (suite at load 10+)."""
    settings = QuorumSettings.for_groups(replicas, tolerated_failures, TIMEOUT)
    return replace(settings, quorum_timeout=max(settings.quorum_timeout, timedelta(seconds=120)))


_MODEL_LOCK = threading.Lock()  # replicas share the process's RNG: build models one at a time


class InjectedKill(Exception):
    pass


def batch(replica: int, step: int, size: int = 8, retry: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of the toy language, different per replica, step and retry of a step (a discarded
    step's gradient is in the error feedback: the retry must not see the same batch again)."""
    permutation = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))
    generator = torch.Generator().manual_seed(1_000_000 * retry + 10_000 * replica + step)
    tokens = [torch.randint(0, VOCAB, (size,), generator=generator)]
    for _ in range(SEQ):
        noise = torch.rand(size, generator=generator) < NOISE
        tokens.append(
            torch.where(noise, torch.randint(0, VOCAB, (size,), generator=generator), permutation[tokens[-1]])
        )
    sequence = torch.stack(tokens, dim=1)
    return sequence[:, :-1], sequence[:, 1:]


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@dataclass
class Faults:
    kill: set = field(default_factory=set)  # (replica, step): the group dies in the step's first collective
    kill_mid: set = field(default_factory=set)  # … in its second all-to-all (a two-stage sync of ≥ 2 buckets)
    kill_inner: set = field(default_factory=set)  # (replica, outer step): dies in its inner steps (DiLoCo)
    failed_allreduce: set = field(default_factory=set)
    nan: set = field(default_factory=set)
    stall: set = field(default_factory=set)  # the group's step lasts at least TIMEOUT, late for the next quorum
    restart_delay_s: float = 0.0  # a killed group starts again this much later (its peers go on without it)
    wait_for_restart_at: int | None = None  # DiLoCo: at this outer step the others wait until it is up again
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, kind: str, replica: int, step: int) -> bool:
        with self._lock:
            planned = getattr(self, kind)
            if (replica, step) in planned:
                planned.discard((replica, step))
                return True
            return False


class FailingProcessGroup(ProcessGroupGloo):
    """torchft's gloo process group whose next all-reduce fails on this replica once ``fail_next`` is
    set, or which dies (its connections closed under the peers) at its next all-reduce once ``die_next`` is.
    The two-stage sync's collectives (all-to-all, all-gather) count too: ``die_next`` set to k > 1
    dies at the k-th all-to-all, in the middle of a sync of several buckets."""

    fail_next = dead = False
    die_next: bool | int = False

    def _die(self, all_to_all: bool = False) -> None:
        if self.die_next is True or (all_to_all and self.die_next == 1):
            self.die_next, self.dead = False, True
            self.abort()
            raise RuntimeError("injected kill: this replica group is gone")
        if all_to_all and self.die_next:
            self.die_next -= 1

    def _failing(self, work):
        if not self.fail_next:
            return work
        self.fail_next = False
        work.wait()  # the peers got their result: only this replica sees the error
        raise RuntimeError("injected collective failure")

    def allreduce(self, tensors, opts):
        self._die()
        return self._failing(super().allreduce(tensors, opts))

    def alltoall_base(self, out, tensor, out_sizes, in_sizes, opts):
        self._die(all_to_all=True)
        return self._failing(super().alltoall_base(out, tensor, out_sizes, in_sizes, opts))

    def allgather_into_tensor_coalesced(self, outs, tensors, opts):
        self._die()
        return self._failing(super().allgather_into_tensor_coalesced(outs, tensors, opts))


def train_replica(
    replica: int,
    lighthouse: str,
    steps: int,
    faults: Faults,
    report: dict,
    quorum: QuorumSettings,
    start: threading.Barrier | None = None,
) -> dict:
    """One attempt of one group. ``start``: passed once its manager is up (and heartbeating), so that
    the lighthouse knows every group before the first quorum and waits for all of them (a group
    that starts late would otherwise join by healing a few steps in: another run than the reference)."""
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = FailingProcessGroup(timeout=quorum.timeout)
    holder: dict = {}
    heals: list[int] = []  # the step of each state received from a peer (torchft loads one only to heal)
    manager = replica_manager(replica, pg, store, lighthouse, quorum, holder, heals)
    checking = contextlib.ExitStack()
    try:
        checker = checking.enter_context(stream_checked(replica, report))  # its steps and heals, when asked
        with checker.device() if checker is not None else contextlib.nullcontext():
            module = initial_model(start, quorum)
            model = DistributedDataParallel(manager, module, EDGCConfig(total_steps=steps, **CONFIG), bucket_cap_mb=0.1)
            optimizer = OptimizerWrapper(manager, torch.optim.Adam(module.parameters(), lr=3e-3))
        holder.update(model=module, optimizer=optimizer)
        state = model.edgc_state
        gradients: dict[str, torch.Tensor] = {}
        retries: dict[int, int] = {}
        reduce = state._reduce

        def recording_reduce(names, grads, flat):  # the local gradient G, before the sync replaces it
            gradients.update({n: g.detach().clone() for n, g in zip(names, grads)})
            return reduce(names, grads, flat)

        state._reduce = recording_reduce
        log = report.setdefault("log", {}).setdefault(replica, [])  # (attempt, step, phase, rank) committed
        attempt = report.setdefault("attempts", {}).setdefault(replica, [0])
        attempt[0] += 1
        step_lines = report.setdefault("steps", {}).setdefault(replica, [])  # as edgc bench's step lines
        while manager.current_step() < steps:
            heals_before = len(heals)
            optimizer.zero_grad()  # starts the quorum; a restarted replica heals here
            step = manager.current_step()
            pg.die_next = faults.take("kill", replica, step)
            stall_until = time.monotonic() + TIMEOUT.total_seconds() if faults.take("stall", replica, step) else 0.0
            error_before = {n: e.clone() for n, e in state.compressor.error.items()}
            gradients.clear()
            retries[step] = retries.get(step, -1) + 1
            loss = loss_of(model, *batch(replica, step, retry=retries[step]))
            if faults.take("nan", replica, step):
                loss = loss * float("nan")
            if faults.take("failed_allreduce", replica, step):
                pg.fail_next = True
            loss.backward()
            if pg.dead:  # the group died in its first collective of the step, its peers in the middle of it
                raise InjectedKill(f"replica {replica} killed at step {step}")
            optimizer.step()  # should_commit: commits or rolls back the EDGC step
            # After the commit: a stall before it would keep the peers in the step's last collectives
            # (EDGC's decision at a window's end) for as long as their timeout, a race lost under load.
            time.sleep(max(0.0, stall_until - time.monotonic()))
            metrics = state.last_step_metrics
            step_lines.append(
                {
                    "kind": "step",
                    "step": step,
                    "committed": metrics.get("committed") is not False,
                    "participants": manager.num_participants(),
                    "participating": manager.participating_rank() is not None,
                    "healed": any(h > 0 for h in heals[heals_before:]),
                }
            )  # at 0: the initial sync
            if metrics.get("committed") is False:
                report.setdefault("discarded", []).append((replica, step))
                check_conserved(state, metrics, error_before, gradients)
            else:
                log.append((attempt[0], step, metrics["phase"], metrics["rank"]))
        checking.close()  # what follows reads results on the host
        module.eval()
        with torch.no_grad():
            final_loss = loss_of(module, *batch(99, 0, size=64)).item()
        return {
            "replica": replica,
            "params": torch.cat([p.detach().reshape(-1) for p in module.parameters()]),
            "shared": state.shared_state_dict(),
            "loss": final_loss,
            "heals": state.heals,
            "discarded": state.steps_discarded,
            "phase": metrics["phase"],
        }
    finally:
        checking.close()
        manager.shutdown(wait=False)
        pg.shutdown()


def replica_manager(
    replica: int, pg, store, lighthouse: str, quorum: QuorumSettings, holder: dict, heals: list[int]
) -> Manager:
    """The group's manager; a peer's model and optimizer state go into ``holder``'s, each heal's step into ``heals``."""

    def load(state: dict) -> None:
        holder["model"].load_state_dict(state["model"])
        holder["optimizer"].load_state_dict(state["optimizer"])
        heals.append(manager.current_step())

    def save() -> dict:
        return {"model": holder["model"].state_dict(), "optimizer": holder["optimizer"].state_dict()}

    manager = Manager(
        pg=pg,
        load_state_dict=load,
        state_dict=save,
        replica_id=str(replica),
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        use_async_quorum=False,
        connect_timeout=quorum.timeout,
        **quorum.manager_kwargs(),
    )
    return manager


@contextlib.contextmanager
def stream_checked(replica: int, report: dict):
    """The body under the CPU stream checker if ``replica`` is one of ``report["checked"]``, its
    findings then in ``report["checker"][replica]``."""
    if replica not in report["checked"]:
        yield None
        return
    with StreamChecker() as checker:
        yield checker
    report.setdefault("checker", {})[replica] = (checker.races, [str(sync) for sync in checker.host_syncs])


def initial_model(start: threading.Barrier | None, quorum: QuorumSettings) -> TinyTransformer:
    """After ``start`` (a first attempt's barrier), the model every replica starts from (float64)."""
    if start is not None:
        start.wait(timeout=quorum.quorum_timeout.total_seconds())
    with _MODEL_LOCK:
        torch.manual_seed(0)
        return TinyTransformer(vocab=VOCAB, width=64, layers=1, heads=2, seq_len=SEQ).double()


def check_conserved(state, metrics: dict, error_before: dict, gradients: dict) -> None:
    """After a discarded step: e = e_before + G, bit for bit, for every compressed matrix."""
    for name, rank in metrics["ranks"].items():
        if not rank:
            continue
        gradient = gradients[name].reshape(gradients[name].shape[0], -1)
        expected = error_before.get(name, torch.zeros_like(gradient)) + gradient
        if not torch.isfinite(gradient).all():
            expected = torch.zeros_like(gradient)
        if not torch.equal(state.compressor.error[name], expected):
            raise AssertionError(f"error feedback of {name} not conserved through the discarded step")


def run_replicas(
    steps: int,
    faults: Faults | None = None,
    replicas: int = 3,
    attempts: int = 3,
    tolerated_failures: int = 1,
    checked: tuple = (),
) -> dict:
    """Train ``replicas`` groups to ``steps`` committed steps; a killed group restarts (up to ``attempts``).
    The quorum settings are the bench's: those of its kill pass, or with ``tolerated_failures=0``
    those of its failure-free passes. The groups in ``checked`` run their steps under the CPU
    stream checker (`edgc_probes.stream_check`): its findings in ``["checker"][group]``."""
    return run_groups(train_replica, steps, faults, replicas, attempts, tolerated_failures, checked)


def run_groups(
    train, steps: int, faults: Faults | None, replicas: int, attempts: int, tolerated_failures: int, checked: tuple = ()
) -> dict:
    """``train(replica, lighthouse, steps, faults, report, quorum, start)`` on one thread per group,
    around one lighthouse; a group whose attempt raises `InjectedKill` starts again."""
    faults = faults or Faults()
    quorum = quorum_settings(replicas, tolerated_failures)
    lighthouse = LighthouseServer(bind="[::]:0", **quorum.lighthouse_kwargs())
    report: dict = {"kills": 0, "checked": set(checked)}
    start = threading.Barrier(replicas)  # first attempts only: a restarted group joins a running quorum

    def runner(replica: int) -> dict:
        for attempt in range(attempts):
            try:
                return train(
                    replica, lighthouse.address(), steps, faults, report, quorum, start if attempt == 0 else None
                )
            except InjectedKill:
                report["kills"] += 1
                time.sleep(faults.restart_delay_s)
        raise RuntimeError(f"replica {replica} ran out of attempts")

    try:
        with ThreadPoolExecutor(max_workers=replicas) as pool:
            futures = [pool.submit(runner, r) for r in range(replicas)]
            results = [f.result(timeout=280) for f in futures]
    finally:
        lighthouse.shutdown()
    return {"results": results, **report}
