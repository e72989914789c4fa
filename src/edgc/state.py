"""`EDGCState`: the EDGC compressor for one data-parallel group, usable as a DDP hook state.

    state = EDGCState(process_group=None, config=EDGCConfig(total_steps=10_000), model=ddp_model)
    ddp_model.register_comm_hook(state, edgc_hook)

Per optimizer step it (1) samples the local gradient for the entropy series (GDS) on due
steps, (2) runs the warm-up error probe or the r_max profiling when planned, (3) syncs
gradients uncompressed or with PowerSGD at the controller's rank, and (4) at decision points
agrees measurements over the group (or a wider ``decision_group``), lets its rank 0 decide and
broadcasts the decision.
Decision points depend only on the step number, so every rank takes part in every broadcast.

It orchestrates; each part is a collaborator it owns: the controller plans each step
(`edgc.control.rank_control.WindowController`), the sampler measures the entropy (`edgc.control.entropy`), the
compressor syncs (`edgc.engine.lowrank.LowRankCompressor`, which holds its state), the profiler times the
shadow syncs (`edgc.control.shadow`), and the decision round agrees and decides (`edgc.control.decisions`). The
step itself is one `edgc.runner.steps.StepRecord`, whose ``plan`` is the controller's `StepPlan`.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import EDGCConfig, dotted_fields
from .control import events
from .control.checkpoint import STATE_FORMAT, check_loadable
from .control.decisions import DecisionRound
from .control.entropy import EntropySampler
from .control.rank_control import WindowController
from .control.shadow import ShadowProfiler
from .device.timing import host_reads_allowed
from .device.totals import StepTotals
from .engine.lowrank import LowRankCompressor
from .policies.plans import COMPRESS, OFF, PROFILE, Agreed, DecisionInputs, StepPlan
from .runner.error_feedback import ErrorFeedback
from .runner.jobs import fusion_megabytes
from .runner.reducer import GradientReducer
from .runner.steps import StepRecord
from .safeguards.fingerprint import SharedFields, compare_replicas

__all__ = ["EDGCState", "STATE_FORMAT"]


class EDGCState(GradientReducer):
    """The EDGC compressor of one data-parallel group: a DDP hook's state (``edgc_hook``), or called
    directly (`synchronize`, `reduce_tensors`). Build one per model, after ``init_process_group``
    (one built before binds the default group at its first step: `edgc.safeguards.guards`).

    What it decides is logged (`edgc.control.events`) and in `last_step_metrics`; once per window the ranks
    compare their shared state (`edgc.safeguards.fingerprint`).

    Args:
        process_group: the group whose gradients it averages; None: the default group. A 1-D
            ``DeviceMesh`` (``mesh["dp_replicate"]``) works too. With DDP, DDP's own group.
        config: every setting (`EDGCConfig`); None: the defaults. Give ``total_steps`` at least.
        model: the DDP model it is registered on (or the module that model wraps, or the module
            whose parameters `synchronize` gets). It names the parameters, so that the compressor's state
            is keyed by name and checkpoints survive another DDP bucket layout; a parameter not in it is
            refused. Without it, parameters are named by order of appearance (warns once).
        follower: for pipeline stages after the first (see `edgc.parallel.pipeline.StageAligner`).
        always_profile: for pipeline stages (see `edgc.parallel.pipeline.StageAligner`).
        decision_group: the ranks that must decide alike, where they are more than
            ``process_group``'s: with tensor parallelism, a stage's DP replicas of all its TP shards
            (`edgc.distributed.mesh.group_across`), so that every shard profiles, warms up and compresses at
            the same step and rank. Measurements are averaged and its rank 0's proposal is broadcast over
            it; gradients still go over ``process_group`` alone.

    Raises:
        TypeError: ``config`` is not an `EDGCConfig`.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        config: EDGCConfig | None = None,
        *,
        model: nn.Module | None = None,
        follower: bool = False,
        always_profile: bool = False,
        decision_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(process_group, model=model)
        self.config = config if config is not None else EDGCConfig()
        if not isinstance(self.config, EDGCConfig):
            raise TypeError(f"config must be an EDGCConfig, got {type(self.config).__name__}")
        self.controller = WindowController(self.config, follower=follower, always_profile=always_profile)
        self.sampler = EntropySampler(self.config)
        if self._guard.shapes:  # the step's element count until a step has counted it (report-only thinning)
            self.sampler.elements_per_step = sum(math.prod(shape) for shape in self._guard.shapes.values())
        self.compressor = LowRankCompressor(self.config.engine)
        self.profiler = ShadowProfiler(self.config.engine)
        self.decisions = DecisionRound()
        self._guard.decide_over(decision_group)  # settings agreed and decisions taken over it (`settings_group`)
        self.watch_tokens(model)

    def watch_tokens(self, model: nn.Module | None) -> None:
        """Read the experts' token counters at each step's first forward through a model, where the rank
        split reads tokens (`edgc.distributed.expert_tokens`, `edgc.policies.rank_split`).

        Args:
            model: the model; None: nothing to watch.
        """
        if self.controller.split.reads_tokens:
            self.experts.watch(model)

    def follow_fsdp(self, model: nn.Module, convention: str) -> None:
        """`GradientReducer.follow_fsdp`, its experts' token counters read through ``model``'s forwards.

        Args:
            model: the model whose forwards count the experts' tokens.
            convention: the gradient scale FSDP's division sets (`edgc.distributed.scaling`).
        """
        super().follow_fsdp(model, convention)
        self.watch_tokens(model)

    # ------------------------------------------------------------------ what the ranks agree on
    def agreed_settings(self, device: torch.device) -> dict[str, Any]:
        """`GradientReducer.agreed_settings`, with every `EDGCConfig` field, the values its "auto" and None
        resolve to on ``device``, and this state's own arguments. The orthonormalisation is the group's
        by then (`edgc.engine.orthonormal_choice`: rank 0's timing, or the checkpoint's), so a timing that differs
        between ranks is no disagreement, and checkpoints that differ are one.

        Args:
            device: the gradients'.

        Returns:
            Name → value of every setting compared.
        """
        config, compressor = self.config, self.compressor
        compressor.agree_orthonormalization(device, self.settings_group())
        fusion = fusion_megabytes(config.fusion_mb, device)
        return {
            **super().agreed_settings(device),
            **{f"EDGCConfig.{name}": value for name, value in dotted_fields(config.to_dict()).items()},
            "EDGCState.follower": self.controller.follower,
            "EDGCState.always_profile": self.controller.always_profile,
            "entropy_estimator in use": config.resolved_entropy_estimator,
            "r_min in use": self.controller.r_min,
            "orthonormalization in use": compressor.orthonormalization(device),
            "fusion_mb in use": fusion,
            "power_iterations": compressor.power_iterations,
        }

    @property
    def _speaker(self) -> int:
        """This rank in the group that decides: its events are said by that group's rank 0 (`edgc.control.events`)."""
        return self.settings_group().rank

    def error_feedbacks(self) -> list[ErrorFeedback]:
        """`GradientReducer.error_feedbacks`.

        Returns:
            The engine's error feedback, by parameter name.
        """
        return [self.compressor.state.feedback]

    # ------------------------------------------------------------------ per step
    def _plan_step(self, record: StepRecord) -> None:
        if record.snapshot is not None:  # an uncommitted step: the shared state from before it, for `_on_verdict`
            record.snapshot.update(self._shared_snapshot())
        self.compressor.state.begin_step(uncommitted=self.defer_commit)
        self.profiler.begin_step()
        self.decisions.begin_step()
        before = self.controller.phase, self.controller.rank  # decisions are in: taken at the settle before
        plan = record.plan = self.controller.plan(record.step)
        events.planned(self._speaker, before, plan, self.controller, self.config)  # the warm-up's end, a hand-set rank
        record.always_timed = plan.phase == PROFILE or plan.profile_rank is not None  # r_max comes from their times
        if plan.rank is not None and plan.profile_rank is None:  # compressed: buckets gathered into larger jobs
            record.fusion_mb = self.config.fusion_mb  # None: the device's default (`edgc.runner.jobs`)
        # Followers take their rank from the pipeline alignment: their entropy is never used.
        sampled = self.config.adaptive and not self.controller.follower and plan.phase != OFF
        self.sampler.begin(record.step, enabled=sampled)
        if self.controller.split.reads_tokens:
            self.experts.count_tokens()  # this step's forward counted them (`edgc.distributed.experts`)
        if plan.rank is not None:
            split = self.controller.split.ranks(plan.rank, self.experts.groups(), self.compressor.compressed_rank)
            self.compressor.state.shares = split  # each expert's own rank, where the split gives one
            # A new rank (decision, hand-set schedule, pipeline alignment): Q follows it here,
            # before any bucket, on every rank alike (`LowRankCompressor.change_rank`), on the jobs'
            # stream that owns Q. A non-finite step puts the old Q back (`EngineMemory.end_step`),
            # and the next step redoes the change.
            with self._jobs.side_stream(after_compute=True):
                elements, nbytes = self.compressor.change_rank(plan.rank, self.comm)
            record.stats.elements_sent += elements
            record.stats.bytes_sent += nbytes

    def _on_device(self, device: torch.device) -> None:
        self.compressor.state.to(device, self._jobs.stream)
        self.profiler.to(device, self._jobs.stream)

    def _use_device(self, device: torch.device) -> None:
        """`GradientReducer._use_device`, then what the group agrees on the device, every rank at the same
        point of its first step: the orthonormalisation it runs (`edgc.engine.orthonormal_choice`), the
        shadow syncs' too."""
        super()._use_device(device)
        self.compressor.agree_orthonormalization(device, self.comm)
        self.profiler.use_orthonormalization(self.compressor.orthonormalization(device))

    def _reduce(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None):
        plan = self._current.plan  # type: ignore[union-attr]
        if self.sampler.sampling and self.experts.marks:  # the experts' exact zeros (dead experts) left out
            experts = [self.experts.is_matrix(name) for name in names]
            self.sampler.add([g for g, e in zip(grads, experts) if not e], [g for g, e in zip(grads, experts) if e])
        else:
            self.sampler.add(grads)  # counts them; a no-op beyond that unless this step is sampled
        if plan.probe_rank is not None:
            self.decisions.probe_bucket(names, grads, plan.probe_rank, self.compressor.config.seed)
        if plan.profile_rank is not None:
            return self.profiler.bucket(
                names, grads, plan, self.comm, self.clock, lambda: self._average_raw(names, grads, flat)
            )
        if plan.rank is None:
            return self._average_raw(names, grads, flat)
        # ‖M − Ĝ‖/‖M‖ costs a pass over M: measured on the GDS cadence only (every round(1/α) steps).
        return self.compressor.reduce_steps(
            names, grads, plan.rank, self.comm, measure_error=self.sampler.due(plan.step)
        )

    def _end_step(self) -> None:
        """`GradientReducer._end_step`, after the rank control's values for the host are added to the step's
        totals by name: the shadow syncs' times, the probes', the entropy sample's estimate."""
        record = self._current
        assert record is not None
        self.profiler.close_step(record.plan, self.comm, self._jobs, self.clock)
        self.decisions.close_step(record.totals)
        with self._jobs.side_stream():  # the sample was gathered there
            self.sampler.close(record.totals)  # its estimate, on the device: read with the step's values
        super()._end_step()

    def _settle_step(self, record: StepRecord, totals: StepTotals) -> dict:
        nonfinite = bool(totals.get("nonfinite"))
        self.compressor.state.end_step(nonfinite)
        if nonfinite:
            events.nonfinite(self._speaker, record.step)
        entropy = self.sampler.settle(totals)
        self.profiler.settle_step()
        self.decisions.settle_step(record.plan, totals)
        plan, controller, last = record.plan, self.controller, self.decisions.last
        budget = controller.budget_state(record.step + 1)
        return {
            "phase": plan.phase,
            "rank": plan.rank,
            "entropy": entropy,
            "entropy_time_s": self.sampler.last_seconds if entropy is not None else 0.0,
            "r_max": controller.r_max,
            "r_min": controller.r_min,
            "rank_budget": budget["budget"] if budget else None,
            "mean_rank": budget["mean_rank"] if budget else None,
            # taken before this step began: it set this step's rank
            "decision": last if last is not None and last["step"] == record.step else None,
        }

    def settle(self) -> None:
        """`GradientReducer.settle`, then what the group settles together, once a step, where every rank
        settles alike (`_settle_group`: collectives)."""
        super().settle()
        record = self._last
        if record is not None and not record.shared_done:
            record.shared_done = True
            with host_reads_allowed():  # a decision reads the agreed values (once per window at most)
                self._settle_group(record)

    def _settle_group(self, record: StepRecord) -> None:
        """At a window's end the replicas' fingerprints are compared (`edgc.safeguards.fingerprint`); at a
        decision step the decision round runs."""
        if (record.step + 1) % self.config.window == 0:
            self._compare_replicas(record.step)
            if self.controller.split.reads_tokens:  # the window's tokens, for the next window's split
                self.controller.split.weights = self.experts.take_tokens(self.comm)
        plan = record.plan
        if not plan.decision:
            return
        device = self.device or torch.device("cpu")
        decides = self.settings_group()
        agreed = self.decisions.agree(self.profiler.mean_times(plan), decides, self.comm, device)
        decision = self.decisions.run(self._decision_inputs(plan, agreed), self.controller, decides, self.comm, device)
        profiling_over = plan.phase == PROFILE and self.controller.phase != PROFILE
        self.profiler.decided(finished=profiling_over)
        if plan.phase == COMPRESS:
            entropy, budget = record.metrics.get("entropy"), self.controller.budget_state(plan.step + 1)
            self.decisions.last = events.decision(self._speaker, plan, decision, entropy, self.config, budget)
        if profiling_over:
            events.profiling_over(self._speaker, record.step + 1, self.controller.profiling_verdict())

    def _compare_replicas(self, step: int) -> None:
        """The replicas' fingerprint at the end of ``step`` (`edgc.safeguards.fingerprint`): the controller's shared
        fields and the engine's Q."""
        c = self.controller
        fields = SharedFields(step, c.phase, c.rank, c.r_max, c.r_min, len(c.schedule))
        compare_replicas(self.comm, fields, self.compressor.q, self.device or torch.device("cpu"))

    def _decision_inputs(self, plan: StepPlan, agreed: Agreed) -> DecisionInputs:
        """What the round's decision reads, from the parts that keep it: the entropy series and the budget
        signals' (the sampler's), the shapes of the matrices the engine compresses at r_max (its record)."""
        history = self.sampler.history
        return DecisionInputs(
            plan,
            agreed,
            entropies=tuple(value for _, value in history),
            sample_steps=tuple(step for step, _ in history),
            signals=self.sampler.signal_series(),
            shapes=self.compressor.compressed_shapes(self.controller.r_max or 1),
        )

    @property
    def last_decision(self) -> dict | None:
        """The last rank decision taken, as a record (its ``step`` is the first step it applies to)."""
        return self.decisions.last

    # ------------------------------------------------------------------ its parts
    def _series(self) -> dict[str, Any]:
        """The parts saved under a key of their own whose snapshot is a copy of their state (small: series
        and schedules)."""
        return {"controller": self.controller, "sampler": self.sampler}

    def _top_level_parts(self) -> tuple:
        """The parts whose entries sit at the top level of the checkpoint and the snapshot."""
        return (self.profiler, self.decisions)

    # ------------------------------------------------------------------ uncommitted steps
    # Per replica: the error feedback (rolled back to M = G + e, see EngineMemory.rollback).
    # Shared (identical on every rank): step, Q, controller, entropy series, profiling state —
    # restored from the snapshot, so a discarded step is not counted anywhere.
    def _shared_snapshot(self) -> dict:
        snapshot = {"q": self.compressor.state.snapshot()}
        for key, part in self._series().items():
            snapshot[key] = copy.deepcopy(part.state_dict())
        for part in self._top_level_parts():
            snapshot.update(part.snapshot())
        return snapshot

    def _on_verdict(self, committed: bool, snapshot: dict) -> None:
        if committed:
            self.compressor.state.commit()
            return
        for key, part in self._series().items():
            part.load_state_dict(snapshot[key])
        for part in self._top_level_parts():
            part.restore(snapshot)
        self.compressor.state.restore(snapshot["q"])
        self.compressor.state.rollback()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """This rank's complete state, keyed by parameter name (not DDP bucket index): `edgc.control.checkpoint`.

        Returns:
            The state, for `load_state_dict`.
        """
        state = {
            "format": STATE_FORMAT,
            **super().state_dict(),
            "rank": self.comm.rank,
            "config": self.config.to_dict(),
            **{key: part.state_dict() for key, part in self._series().items()},
            "compressor": self.compressor.state_dict(),
            "expert_tokens": self.experts.state_dict(),
        }
        for part in self._top_level_parts():
            state.update(part.state_dict())
        return state

    def shared_state_dict(self) -> dict:
        """`state_dict()` without this rank's error feedback: the part every replica holds identically
        (step, Q, rank schedule, controller, entropy series), what a healing replica takes from a peer.

        Returns:
            The shared state, for `load_shared_state_dict`.
        """
        own = {"compressor": self.compressor.state_dict(include_error=False), "expert_tokens": {}}
        return {**self.state_dict(), **own, "shared": True}

    def load_shared_state_dict(self, state: dict) -> None:
        """Load a peer's `shared_state_dict()`, keeping this rank's own error feedback (none after a restart).

        Args:
            state: the peer's shared state.
        """
        self._load(state, keep_own=True)

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`.

        Args:
            state: what `state_dict` returned.

        Raises:
            ValueError: a malformed or mismatched state; nothing is changed.
        """
        self._load(state, keep_own=False)

    def _load(self, state: dict, *, keep_own: bool) -> None:
        """Load ``state``; ``keep_own``: this rank's own part (error feedback, expert tokens) stays."""
        # the experts this rank holds, of a checkpoint saved at another ep: continued or refused in one line
        if isinstance(state, dict) and isinstance(state.get("compressor"), dict):
            state = {**state, "compressor": self.experts.restricted(state["compressor"])}
        check_loadable(state, self.config, self.controller.follower, self.parameter_shapes)
        saved, now = dotted_fields(state["config"]), dotted_fields(self.config.to_dict())  # saved: flat or nested
        if saved != now:
            changed = sorted(k for k, v in saved.items() if now.get(k) != v)
            warnings.warn(f"EDGCState: loading state saved with different config fields {changed}", stacklevel=3)
        super().load_state_dict(state)
        for key, part in self._series().items():
            part.load_state_dict(state[key])
        self.compressor.load_state_dict(state["compressor"], keep_error=keep_own)
        for part in self._top_level_parts():
            part.load_state_dict(state)
        if not keep_own:
            self.experts.load_state_dict(state.get("expert_tokens", {}), self.device)
        resized = int(state["world_size"]) != self.comm.world_size
        if not state.get("shared") and self.comm.residuals_per_rank and resized:
            # Residuals are per rank and cannot be split or merged exactly: drop them, keep the rest.
            warnings.warn(
                f"EDGCState: world size changed from {state['world_size']} to {self.comm.world_size}; "
                "error feedback is reset (step, rank schedule, entropy history and Q factors are kept)",
                stacklevel=3,
            )
            self.compressor.state.drop_error()
        if self.device is not None:
            self._on_device(self.device)
