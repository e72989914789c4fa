"""The decision round: how what the ranks measured becomes one decision that every rank applies.

At a decision point (``StepPlan.decision``, settled where every rank settles alike) each rank's
measurements (`edgc.plans.Agreed`: profiling times, the warm-up probe, the window's relative
compression error) are **agreed**, averaged in one all-reduce over the decision group; the group's
rank 0 **proposes** a decision from the agreed values and its series (`WindowController.propose`);
the proposal is **broadcast**; and every rank **applies** the same one (`WindowController.apply`),
so the ranks never diverge. The decision group is the state's process group, or a wider one where
more ranks must decide alike (tensor parallelism: a stage's DP replicas of all its TP shards).

`DecisionRound` runs the round and keeps what it reads that no other part keeps: the warm-up probe
of the step, the relative errors measured since the last decision, and the matrices' shapes (the
cqm mapping's error model needs them).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import Communicator
from .entropy import EntropySampler
from .factors import matrix_shape, orthonormalize_rows_, stable_seed
from .lowrank import LowRankCompressor
from .plans import COMPRESS, Agreed, Decision, StepPlan
from .rank_control import WindowController
from .timing import to_device


class DecisionRound:
    """The round of one state (see the module docstring). ``group``: the decision group where it is
    wider than the state's process group (None: the state's communicator decides)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.wider = None if group is None else Communicator(group)
        self.shapes: dict[str, tuple[int, int]] = {}  # name → (m, n) of every matrix seen, recorded once
        self.relative_errors: list[float] = []  # ‖M − Ĝ‖²/‖M‖² of the measured steps since the last decision
        self.probe: torch.Tensor | None = None  # this step's (error², ‖M‖²) on the device, summed over buckets
        self.probe_values: list[float] | None = None  # the settled step's, on the host
        self.last: dict | None = None  # the last rank decision taken, as a record for people (`edgc.events`)

    def communicator(self, comm: Communicator) -> Communicator:
        """The communicator that decides: the wider one, else the state's ``comm``."""
        return self.wider or comm

    def __getstate__(self) -> dict:
        """A process group stays with this process, as the state's communicator does (`edgc.detached`)."""
        from .detached import DetachedCommunicator

        wider = self.wider
        if wider is None:
            return dict(self.__dict__)
        return {**self.__dict__, "wider": DetachedCommunicator("EDGCState", wider.rank, wider.world_size)}

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        self.probe = None

    def note_bucket(
        self, names: list[str], grads: list[torch.Tensor], probe_rank: int | None, compressor: LowRankCompressor
    ) -> None:
        """A bucket's matrix shapes; with ``probe_rank``, its warm-up probe (`probe_error`, with the seed of
        ``compressor``)."""
        for name, grad in zip(names, grads):
            if name not in self.shapes and (shape := matrix_shape(grad)) is not None:
                self.shapes[name] = shape
        if probe_rank is not None:
            probe = probe_error(names, grads, probe_rank, compressor.config.seed)
            self.probe = probe if self.probe is None else self.probe + probe

    def device_values(self) -> list[torch.Tensor]:
        """What the step needs on the host besides the reducer's values: the probe, where it was taken."""
        return [] if self.probe is None else [self.probe]

    def settle_step(self, plan: StepPlan, host: list[float]) -> None:
        """The step's values are on the host (``host[3:5]``: the probe, where taken): keep what a decision reads."""
        self.probe_values = host[3:5] if self.probe is not None else None
        if plan.phase == COMPRESS and host and host[2] > 0:  # ‖M − Ĝ‖²/‖M‖², measured this step
            self.relative_errors.append(host[1] / host[2])

    # ------------------------------------------------------------------ the round
    def measured(self, profiled: tuple[float, float, float]) -> Agreed:
        """This rank's measurements: ``profiled`` (`edgc.shadow.ShadowProfiler.mean_times`), the probe
        and the window's relative error."""
        probe, errors = self.probe_values, self.relative_errors
        return Agreed(
            profile_time=profiled[0],
            uncompressed_time=profiled[1],
            # The warm-up test is relative (‖M − M̂‖²/‖M‖²): the absolute error tracks the gradient
            # scale, which falls during training whatever the rank structure does.
            probe_error=(probe[0] / probe[1] if probe[1] > 0 else math.inf) if probe is not None else math.nan,
            relative_error=sum(errors) / len(errors) if errors else math.nan,
            # The quick test: the host blocked this long on the plain sync after backward, so it took at least that.
            uncompressed_bound=profiled[2],
        )

    def run(
        self,
        plan: StepPlan,
        profiled: tuple[float, float, float],
        controller: WindowController,
        sampler: EntropySampler,
        compressor: LowRankCompressor,
        comm: Communicator,
        device: torch.device,
    ) -> Decision:
        """Agree this rank's measurements (`measured`, with ``profiled``) over the decision group, let
        its rank 0 propose, broadcast, and apply the decision to ``controller`` (every rank alike);
        returns it. Two blocking collectives."""
        decisions, local = self.communicator(comm), self.measured(profiled)
        agreed = Agreed(*decisions.mean_(torch.tensor(local.encode(), dtype=torch.float64, device=device)).tolist())
        if decisions.rank == 0:
            shapes = [s for s in self.shapes.values() if compressor.compressed_rank(s, controller.r_max or 1)]
            history = sampler.history
            proposal = controller.propose(
                plan,
                agreed,
                [v for _, v in history],
                shapes,
                sample_steps=[s for s, _ in history],
                signals=sampler.signal_series(),
            )
        else:
            proposal = controller.current()
        vector = decisions.broadcast(torch.tensor(proposal.encode(), dtype=torch.float64, device=device))
        if decisions is not comm:
            decisions.reset()  # its two collectives are no gradient traffic: not the step's to report
        decision = Decision.decode(vector.tolist())
        controller.apply(plan, agreed, decision)
        self.relative_errors.clear()
        return decision

    # ------------------------------------------------------------------ uncommitted steps, checkpoints
    # Its entry sits at the top level of the state's checkpoint and snapshot, where it always was.
    def state_dict(self) -> dict:
        """The relative errors measured since the last decision."""
        return {"relative_errors": list(self.relative_errors)}

    def load_state_dict(self, state: dict) -> None:
        """A `state_dict()`'s entry (none in a state saved before it was kept: no error measured)."""
        self.relative_errors = [float(e) for e in state.get("relative_errors", [])]

    def snapshot(self) -> dict:
        return self.state_dict()

    def restore(self, snapshot: dict) -> None:
        self.relative_errors = snapshot["relative_errors"]


def probe_error(names: list[str], grads: list[torch.Tensor], rank: int, seed: int) -> torch.Tensor:
    """(‖M − M̂_rank‖², ‖M‖²) of one seeded randomised power iteration, summed over local matrices.

    The warm-up test's measurement; local only (no communication), seeded per parameter (by ``seed``
    and its name) so the same gradient always gives the same value, and returned as a float64
    device tensor (read at the end of the step). A non-finite gradient gives an infinite error.
    """
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for name, grad in zip(names, grads):
        shape = matrix_shape(grad)
        if shape is None:
            continue
        m, n = shape
        r = min(rank, m, n)
        matrix = grad.detach().view(m, n).float()
        generator = torch.Generator().manual_seed(stable_seed(seed, name, "probe"))
        q = to_device(torch.randn(1, n, r, generator=generator), grad.device).transpose(1, 2)
        p = orthonormalize_rows_(torch.bmm(q, matrix.T.unsqueeze(0)))[0]  # Pᵀ (r × m) of P = orth(M·Q)
        error = (matrix - p.T @ (p @ matrix)).square().sum().double()
        norm = matrix.square().sum().double()
        total += torch.stack([torch.where(torch.isfinite(error), error, float("inf")), norm])
    return total
