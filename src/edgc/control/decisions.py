"""The decision round: how what the ranks measured becomes one decision that every rank applies.

At a decision point (``StepPlan.decision``, settled where every rank settles alike) each rank's
measurements (`edgc.policies.plans.Agreed`: profiling times, the warm-up probe, the window's relative
compression error) are **agreed**, averaged in one all-reduce over the decision group (`agree`);
with the series and shapes the state's parts keep they make the round's `edgc.policies.plans.DecisionInputs`,
built once; the group's rank 0 **proposes** a decision from them (`WindowController.propose`); the
proposal is **broadcast**; and every rank **applies** the same one (`WindowController.apply`), so
the ranks never diverge (`run`). The decision group is the state's process group, or a wider one
where more ranks must decide alike (tensor parallelism: a stage's DP replicas of all its TP shards).

`DecisionRound` runs the round and keeps what it reads that no other part keeps: the warm-up probe
of the step and the relative errors measured since the last decision. (The matrices' shapes, which
the cqm mapping's error model needs, are the engine's record: `LowRankCompressor.compressed_shapes`.)
"""

from __future__ import annotations

import math

import torch

from ..device.timing import to_device
from ..device.totals import StepTotals
from ..distributed.comm import Communicator
from ..engine.factors import matrix_shape, orthonormalize_rows_
from ..policies.plans import COMPRESS, Agreed, Decision, DecisionInputs, StepPlan
from ..runner.seeds import stable_seed
from .rank_control import WindowController


class DecisionRound:
    """The round of one state (see the module docstring). The decision group is the state's
    (`GradientReducer.settings_group`): the round is handed its communicator."""

    def __init__(self):
        self.relative_errors: list[float] = []  # ‖M − Ĝ‖²/‖M‖² of the measured steps since the last decision
        self.probe: torch.Tensor | None = None  # this step's (error², ‖M‖²) on the device, summed over buckets
        self.probe_values: tuple[float, float] | None = None  # the settled step's (‖M − M̂‖², ‖M‖²), on the host
        self.last: dict | None = None  # the last rank decision taken, as a record for people (`edgc.control.events`)

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        self.probe = None

    def probe_bucket(self, names: list[str], grads: list[torch.Tensor], rank: int, seed: int) -> None:
        """A bucket's warm-up probe at ``rank`` (`probe_error`, with the engine's ``seed``), summed into the step's."""
        probe = probe_error(names, grads, rank, seed)
        self.probe = probe if self.probe is None else self.probe + probe

    def close_step(self, totals: StepTotals) -> None:
        """What the step needs on the host besides the reducer's values, into ``totals`` by name: the probe's
        ‖M − M̂‖² and ‖M‖², where it was taken."""
        if self.probe is not None:
            totals.add_vector(("probe_error_sq", "probe_norm_sq"), self.probe)

    def settle_step(self, plan: StepPlan, totals: StepTotals) -> None:
        """The step's values are on the host (``totals``, read): keep what a decision reads."""
        probed = "probe_error_sq" in totals
        self.probe_values = (totals["probe_error_sq"], totals["probe_norm_sq"]) if probed else None
        norm_sq = totals.get("norm_sq")
        if plan.phase == COMPRESS and norm_sq > 0:  # ‖M − Ĝ‖²/‖M‖², measured this step
            self.relative_errors.append(totals["error_sq"] / norm_sq)

    # ------------------------------------------------------------------ the round
    def measured(self, profiled: tuple[float, float, float]) -> Agreed:
        """This rank's measurements: ``profiled`` (`edgc.control.shadow.ShadowProfiler.mean_times`), the probe
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

    def agree(
        self, profiled: tuple[float, float, float], decisions: Communicator, comm: Communicator, device: torch.device
    ) -> Agreed:
        """This rank's measurements (`measured`, with ``profiled``) averaged over the decision group
        (``decisions``: the state's ``comm``, or a wider group's): the round's first blocking collective."""
        local = torch.tensor(self.measured(profiled).encode(), dtype=torch.float64, device=device)
        agreed = Agreed(*decisions.mean_(local).tolist())
        self._not_gradient_traffic(decisions, comm)
        return agreed

    def run(
        self,
        inputs: DecisionInputs,
        controller: WindowController,
        decisions: Communicator,
        comm: Communicator,
        device: torch.device,
    ) -> Decision:
        """The round's decision from ``inputs`` (built once, with the `agree`-d measurements): the decision
        group's (``decisions``') rank 0 proposes, the proposal is broadcast (the round's second blocking
        collective), and every rank applies it to ``controller`` alike; returns it."""
        proposal = controller.propose(inputs) if decisions.rank == 0 else controller.current()
        vector = decisions.broadcast(torch.tensor(proposal.encode(), dtype=torch.float64, device=device))
        self._not_gradient_traffic(decisions, comm)
        decision = Decision.decode(vector.tolist())
        controller.apply(inputs, decision)
        self.relative_errors.clear()
        return decision

    @staticmethod
    def _not_gradient_traffic(decisions: Communicator, comm: Communicator) -> None:
        """The wider group's collectives are no gradient traffic: not the step's to report."""
        if decisions is not comm:
            decisions.reset()

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
