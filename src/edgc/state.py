"""`EDGCState`: the EDGC compressor for one data-parallel group, usable as a DDP hook state.

    state = EDGCState(process_group=None, config=EDGCConfig(total_steps=10_000), model=ddp_model)
    ddp_model.register_comm_hook(state, edgc_hook)

Per optimizer step it (1) samples the local gradient for the entropy series (GDS) on due
steps, (2) runs the warm-up error probe or the r_max profiling when planned, (3) syncs
gradients uncompressed or with PowerSGD at the controller's rank, and (4) at decision points
agrees measurements over the group (or a wider ``decision_group``), lets its rank 0 decide and
broadcasts the decision.
Decision points depend only on the step number, so every rank takes part in every broadcast.
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from . import events
from .comm import Communicator, run_job
from .config import EDGCConfig
from .entropy import EntropySampler
from .factors import matrix_shape
from .fingerprint import compare_replicas
from .lowrank import LowRankCompressor
from .plans import OFF, PROFILE, Agreed, Decision, StepPlan
from .profiling import profile_seconds
from .rank_control import WindowController
from .reducer import GradientReducer
from .timing import Clock

STATE_FORMAT = "edgc-state/1"
# Compressed steps on an accelerator gather DDP buckets into jobs of this many MB (EDGCConfig.fusion_mb):
# a job's kernel launches are a fixed count plus a few per shape (edgc.jobs).
DEFAULT_ACCELERATOR_FUSION_MB = 256


class EDGCState(GradientReducer):
    """The EDGC compressor of one data-parallel group: a DDP hook's state (``edgc_hook``), or called
    directly (`synchronize`, `reduce_tensors`). Build one per model, after ``init_process_group``
    (one built before binds the default group at its first step: `edgc.guards`).

    - ``process_group``: the group whose gradients it averages; None: the default group. A 1-D
      ``DeviceMesh`` (``mesh["dp_replicate"]``) works too. With DDP, DDP's own group.
    - ``config``: every setting (`EDGCConfig`); None: the defaults. Give ``total_steps`` at least.
    - ``model``: the DDP model it is registered on (or the module that model wraps, or the module
      whose parameters `synchronize` gets). It names the parameters, so that the compressor's state
      is keyed by name and checkpoints survive another DDP bucket layout; a parameter not in it is
      refused. Without it, parameters are named by order of appearance (warns once).
    - ``follower``, ``always_profile``: for pipeline stages (see `edgc.pipeline.StageAligner`).
    - ``decision_group``: the ranks that must decide alike, where they are more than
      ``process_group``'s: with tensor parallelism, a stage's DP replicas of all its TP shards
      (`edgc.mesh.group_across`), so that every shard profiles, warms up and compresses at the same
      step and rank. Measurements are averaged and its rank 0's proposal is broadcast over it;
      gradients still go over ``process_group`` alone.

    What it decides is logged (`edgc.events`) and in `last_step_metrics`; once per window the ranks
    compare their shared state (`edgc.fingerprint`).
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
        # Decisions are agreed over the process group unless a wider group must agree too.
        self._wider_decisions = None if decision_group is None else Communicator(decision_group)
        self.config = config if config is not None else EDGCConfig()
        if not isinstance(self.config, EDGCConfig):
            raise TypeError(f"config must be an EDGCConfig, got {type(self.config).__name__}")
        self.compressor = LowRankCompressor(self.config.engine)
        self.sampler = EntropySampler(self.config)
        if self.parameter_shapes:  # the step's element count until a step has counted it (report-only thinning)
            self.sampler.elements_per_step = sum(math.prod(shape) for shape in self.parameter_shapes.values())
        self.controller = WindowController(self.config, follower=follower, always_profile=always_profile)
        # Profiling times a compressed sync beside the real one, with its own Q and no error
        # feedback, so training itself stays exactly uncompressed until warm-up ends.
        self._profiler = self._new_profiler()
        self._shapes: dict[str, tuple[int, int]] = {}
        self._plan = StepPlan(0, self.controller.phase, None)
        # Since the last decision: [compressed s, steps that timed it, uncompressed s, steps that timed it].
        self._profile_seconds = [0.0, 0, 0.0, 0]
        self._probe: torch.Tensor | None = None
        self._profile_stamps: list[tuple] = []  # this step's (start, end) of the timed shadow syncs
        self._raw_stamps: list[tuple] = []  # … and of the blocking plain syncs (`StepPlan.profile_raw`)
        self._deferred_shadow: list[tuple[list[str], list[torch.Tensor]]] = []
        self._plain_waits: list[tuple] = []  # the quick test's (`StepPlan.profile_bound`) waits for the plain sync
        self._measure_error = False
        self._relative_errors: list[float] = []  # ‖M − Ĝ‖²/‖M‖² of the measured steps since the last decision
        self._last_entropy: float | None = None
        self._decision: dict | None = None  # the last rank decision taken, as a record for people
        self._settled_probe: list[float] | None = None  # the closed step's warm-up probe, for its decision

    def _new_profiler(self) -> LowRankCompressor:
        return LowRankCompressor(replace(self.config.engine, error_feedback=False))

    # ------------------------------------------------------------------ per step
    def _begin_step(self) -> None:
        super()._begin_step()
        self.compressor.begin_step(uncommitted=self.defer_commit)
        before = self.controller.phase, self.controller.rank  # decisions are in: taken at the settle above
        self._plan = self.controller.plan(self.step)
        events.planned(self, before, self._plan)  # the warm-up's end, a hand-set rank
        self.clock.enabled = self._timed()
        # Followers take their rank from the pipeline alignment: their entropy is never used.
        sampled = self.config.adaptive and not self.controller.follower and self._plan.phase != OFF
        self.sampler.begin(self.step, enabled=sampled)
        if self._plan.rank is not None:
            # A new rank (decision, hand-set schedule, pipeline alignment): Q follows it here,
            # before any bucket, on every rank alike (`LowRankCompressor.change_rank`), on the jobs'
            # stream that owns Q. A non-finite step puts the old Q back (`end_step`), and the next
            # step redoes the change.
            with self._jobs.side_stream(after_compute=True):
                elements, nbytes = self.compressor.change_rank(self._plan.rank, self.comm)
            self._stats.elements_sent += elements
            self._stats.bytes_sent += nbytes
        # ‖M − Ĝ‖/‖M‖ costs a pass over M: measured on the GDS cadence only (every round(1/α) steps).
        self._measure_error = self.sampler.due(self.step)
        self._probe: torch.Tensor | None = None  # (error², ‖M‖²) on the device, summed over buckets
        self._profile_stamps, self._raw_stamps, self._deferred_shadow, self._plain_waits = [], [], [], []

    def _on_device(self, device: torch.device) -> None:
        for compressor in (self.compressor, self._profiler):
            compressor.to(device, self._jobs.stream)

    def _timed(self) -> bool:
        """Profiling steps are always timed: r_max comes from their times."""
        plan = getattr(self, "_plan", None)
        return super()._timed() or (plan is not None and (plan.phase == PROFILE or plan.profile_rank is not None))

    def _fusion_bytes(self) -> float:
        """Compressed steps gather buckets into jobs of `EDGCConfig.fusion_mb` (`edgc.jobs`)."""
        if self._plan.rank is None or self._plan.profile_rank is not None:
            return 0  # uncompressed: each bucket all-reduced in place, as DDP would
        megabytes = self.config.fusion_mb
        if megabytes is None:
            megabytes = 0 if self.device is None or self.device.type == "cpu" else DEFAULT_ACCELERATOR_FUSION_MB
        return megabytes * 2 ** 20

    def _reduce(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None):
        plan = self._plan
        self.sampler.add(grads)  # a no-op unless this step is sampled
        for name, grad in zip(names, grads):  # matrix shapes for the CQM mapping, recorded once
            if name not in self._shapes and (shape := matrix_shape(grad)) is not None:
                self._shapes[name] = shape
        if plan.probe_rank is not None:
            probe = self.compressor.probe_error(names, grads, plan.probe_rank)
            self._probe = probe if self._probe is None else self._probe + probe
        if plan.profile_rank is not None:
            return self._profile(names, grads, flat, plan)
        if plan.rank is None:
            return self._average_raw(names, grads, flat)
        return self.compressor.reduce_steps(names, grads, plan.rank, self.comm, measure_error=self._measure_error)

    def _profile(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None, plan: StepPlan):
        """A profiling bucket. With ``plan.profile_raw``, blocking: a timed shadow compressed sync,
        then the real plain one, timed. Otherwise the plain sync overlaps backward as in warm-up and
        the shadow sync is timed at the step's end, when no other transfer shares the link (the quick
        test, ``plan.profile_bound``, also keeps the step's waits for the plain sync, in `_end_step`)."""
        if not plan.profile_raw:
            self._deferred_shadow.append((names, grads))  # only their shapes matter by then
            return self._average_raw(names, grads, flat)
        self._time_shadow_sync(names, grads, plan)
        raw_start = self.clock.stamp()
        self._add_stats(run_job(self._average_raw(names, grads, flat)))
        self._raw_stamps.append((raw_start, self.clock.stamp()))
        return None

    def _time_shadow_sync(self, names: list[str], grads: list[torch.Tensor], plan: StepPlan) -> None:
        """One blocking compressed sync of copies of ``grads`` at ``plan.profile_rank``, timed, not counted."""
        issued_before = self.comm.mark()
        for _ in range(2 if plan.profile_warm else 1):  # only the last call's time counts
            shadow = [g.detach().clone() for g in grads]
            start = self.clock.stamp()
            self._profiler.reduce(names, shadow, plan.profile_rank, self.comm, measure_error=False)  # type: ignore[arg-type]
            end = self.clock.stamp()
        self.comm.forget_since(*issued_before)  # the shadow sync is not the step's traffic
        self._profile_stamps.append((start, end))

    def _end_step(self) -> None:
        deferred, self._deferred_shadow = self._deferred_shadow, []
        if self._plan.profile_bound:  # before the shadow sync adds its own waits
            self._plain_waits = self.comm.wait_stamps()
        if deferred:  # every plain sync of the step has completed
            with self._jobs.working():  # profiling's cost shows as compress time
                for names, grads in deferred:
                    self._time_shadow_sync(names, grads, self._plan)
        super()._end_step()

    def _device_values(self) -> list[torch.Tensor]:
        values = super()._device_values()
        if self._probe is not None:
            values.extend(self._probe.unbind())
        return values

    def _after_values(self, host: list[float], closed) -> None:
        self.compressor.end_step(bool(host and host[0]))
        if host and host[0]:
            events.nonfinite(self, closed.step)
        self._last_entropy = self.sampler.finish()
        plan = self._plan
        for offset, stamps in ((0, self._profile_stamps), (2, self._raw_stamps)):
            seconds = Clock.total(stamps) if stamps else None
            if seconds is not None:
                self._profile_seconds[offset] += seconds
                self._profile_seconds[offset + 1] += 1
        self._settled_probe = host[3:5] if self._probe is not None else None
        if plan.phase == "compress" and host and host[2] > 0:  # ‖M − Ĝ‖²/‖M‖², measured this step
            self._relative_errors.append(host[1] / host[2])

    def _after_group(self, closed) -> None:
        """Where every rank settles alike (collectives): at a window's end the replicas' fingerprints
        are compared (`edgc.fingerprint`); at a decision step the rank decision is taken."""
        if (closed.step + 1) % self.config.window == 0:
            compare_replicas(self, closed.step)
        if self._plan.decision:
            self._decide(self._plan, self._settled_probe)
            if self._plan.phase == PROFILE and self.controller.phase != PROFILE:
                self._profiler = self._new_profiler()  # profiling is over: its shadow Q factors are garbage
                events.profiling_over(self, closed.step + 1)

    def _decide(self, plan: StepPlan, probe: list[float] | None) -> None:
        compressed, compressed_steps, uncompressed, uncompressed_steps = self._profile_seconds
        errors = self._relative_errors
        local = Agreed(
            profile_time=compressed / compressed_steps if compressed_steps else math.nan,
            uncompressed_time=uncompressed / uncompressed_steps if uncompressed_steps else math.nan,
            # The warm-up test is relative (‖M − M̂‖²/‖M‖²): the absolute error tracks the gradient
            # scale, which falls during training whatever the rank structure does.
            probe_error=(probe[0] / probe[1] if probe[1] > 0 else math.inf) if probe is not None else math.nan,
            relative_error=sum(errors) / len(errors) if errors else math.nan,
            # The quick test: the host blocked this long on the plain sync after backward, so it took at least that.
            uncompressed_bound=(Clock.total(self._plain_waits) or 0.0) if plan.profile_bound else math.nan,
        )
        device, decisions = self.device or torch.device("cpu"), self._wider_decisions or self.comm
        agreed = Agreed(*decisions.mean_(torch.tensor(local.encode(), dtype=torch.float64, device=device)).tolist())
        if decisions.rank == 0:
            shapes = [s for s in self._shapes.values() if self.compressor.compressed_rank(s, self.controller.r_max or 1)]
            history = self.sampler.history
            proposal = self.controller.propose(plan, agreed, [v for _, v in history], shapes,
                                               sample_steps=[s for s, _ in history],
                                               signals=self.sampler.signal_series())
        else:
            proposal = self.controller.current()
        vector = decisions.broadcast(torch.tensor(proposal.encode(), dtype=torch.float64, device=device))
        if decisions is not self.comm:
            decisions.reset()  # its two collectives are no gradient traffic: not the step's to report
        decision = Decision.decode(vector.tolist())
        self.controller.apply(plan, agreed, decision)
        if plan.phase == "compress":
            self._decision = events.decision(self, plan, decision, self._last_entropy)
        self._profile_seconds = [0.0, 0, 0.0, 0]
        errors.clear()

    @property
    def last_decision(self) -> dict | None:
        """The last rank decision taken, as a record (its ``step`` is the first step it applies to)."""
        return self._decision

    def _step_metrics(self, closed) -> dict:
        plan = self._plan
        budget = self.controller.budget_state(closed.step + 1)
        decision = self._decision if self._decision is not None and self._decision["step"] == closed.step else None
        return {
            "phase": plan.phase,
            "rank": plan.rank,
            "entropy": self._last_entropy,
            "entropy_time_s": self.sampler.last_seconds if self._last_entropy is not None else 0.0,
            "r_max": self.controller.r_max,
            "r_min": self.controller.r_min,
            "rank_budget": budget["budget"] if budget else None,
            "mean_rank": budget["mean_rank"] if budget else None,
            "decision": decision,  # taken before this step began: it set this step's rank
        }

    # ------------------------------------------------------------------ uncommitted steps
    # Per replica: the error feedback (rolled back to M = G + e, see LowRankCompressor.rollback).
    # Shared (identical on every rank): step, Q, controller, entropy series, profiling state —
    # restored from the snapshot, so a discarded step is not counted anywhere.
    def _snapshot(self) -> dict:
        return {
            **super()._snapshot(),
            "controller": copy.deepcopy(self.controller.state_dict()),
            "sampler": copy.deepcopy(self.sampler.state_dict()),
            "q": self.compressor.snapshot(),
            "profiler_q": self._profiler.snapshot(),
            "profile_seconds": list(self._profile_seconds),
            "relative_errors": list(self._relative_errors),
        }

    def _restore(self, snapshot: dict) -> None:
        super()._restore(snapshot)
        self.controller.load_state_dict(snapshot["controller"])
        self.sampler.load_state_dict(snapshot["sampler"])
        self.compressor.restore(snapshot["q"])
        self._profiler.restore(snapshot["profiler_q"])
        self._profile_seconds = snapshot["profile_seconds"]
        self._relative_errors = snapshot["relative_errors"]
        self.compressor.rollback()

    def _commit(self) -> None:
        self.compressor.commit()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        if self._wider_decisions is not None:  # a process group stays with this process, as `comm` does
            from .detached import DetachedCommunicator

            wider = self._wider_decisions
            state["_wider_decisions"] = DetachedCommunicator(type(self).__name__, wider.rank, wider.world_size)
        return state

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """This rank's complete state, keyed by parameter name (not DDP bucket index)."""
        return {
            "format": STATE_FORMAT,
            **super().state_dict(),
            "rank": self.comm.rank,
            "config": self.config.to_dict(),
            "controller": self.controller.state_dict(),
            "sampler": self.sampler.state_dict(),
            "compressor": self.compressor.state_dict(),
            "profiler": self._profiler.state_dict(),
            "profile_seconds": list(self._profile_seconds),
            "relative_errors": list(self._relative_errors),
        }

    def shared_state_dict(self) -> dict:
        """`state_dict()` without this rank's error feedback: the part every replica holds identically
        (step, Q, rank schedule, controller, entropy series), what a healing replica takes from a peer."""
        return {**self.state_dict(), "compressor": self.compressor.state_dict(include_error=False), "shared": True}

    def load_shared_state_dict(self, state: dict) -> None:
        """Load a peer's `shared_state_dict()`, keeping this rank's own error feedback (none after a restart)."""
        error = self.compressor.error
        self.load_state_dict(state)
        self.compressor.error = error

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`; a malformed or mismatched state raises ValueError and changes nothing."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not an EDGC state (expected format {STATE_FORMAT!r})")
        self._check_loadable(state)
        if state["config"] != self.config.to_dict():
            changed = sorted(k for k, v in state["config"].items() if self.config.to_dict().get(k) != v)
            warnings.warn(f"EDGCState: loading state saved with different config fields {changed}", stacklevel=2)
        super().load_state_dict(state)
        self.controller.load_state_dict(state["controller"])
        self.sampler.load_state_dict(state["sampler"])
        self.compressor.load_state_dict(state["compressor"])
        self._profiler.load_state_dict(state["profiler"])
        self._profile_seconds = profile_seconds(state["profile_seconds"])
        self._relative_errors = [float(e) for e in state.get("relative_errors", [])]
        if not state.get("shared") and int(state["world_size"]) != self.comm.world_size:
            # Residuals are per rank and cannot be split or merged exactly: drop them, keep the rest.
            warnings.warn(
                f"EDGCState: world size changed from {state['world_size']} to {self.comm.world_size}; "
                "error feedback is reset (step, rank schedule, entropy history and Q factors are kept)",
                stacklevel=2,
            )
            self.compressor.drop_error()
        if self.device is not None:
            self._on_device(self.device)

    def _check_loadable(self, state: dict) -> None:
        """Validate everything first, so a bad checkpoint cannot leave the state half-loaded."""
        required = ("step", "totals", "world_size", "config", "controller", "sampler", "compressor", "profiler",
                    "profile_seconds")
        missing = [key for key in required if key not in state]
        if missing:
            raise ValueError(f"corrupt EDGC state: missing {missing}")
        try:
            WindowController(self.config, follower=self.controller.follower).load_state_dict(state["controller"])
            EntropySampler(self.config).load_state_dict(state["sampler"])
            profile_seconds(state["profile_seconds"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"corrupt EDGC state: {exc!r}") from exc
        compressor = state["compressor"]
        if not isinstance(compressor, dict) or not {"q", "error"} <= set(compressor) <= {"q", "error", "shapes"}:
            raise ValueError("corrupt EDGC state: compressor must hold 'q' and 'error' (and optionally 'shapes')")
        if not self.parameter_shapes:
            return  # no model given: nothing to check shapes against
        for kind in ("q", "error"):
            for name, tensor in compressor[kind].items():
                shape = self.parameter_shapes.get(name)
                if shape is None:
                    raise ValueError(f"EDGC state has {kind} for parameter {name!r}, which the model does not have")
                rows, cols = shape[0], math.prod(shape[1:])
                # Q sits on the columns; a state saved with Q on the shorter side is accepted too:
                # a warm start that no longer fits is drawn anew (edgc.rank_change.resize_q).
                expected = [(rows, cols)] if kind == "error" else [(cols,), (min(rows, cols),)]
                if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape[: len(expected[0])]) not in expected:
                    got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                    raise ValueError(f"EDGC state {kind} of {name!r} has shape {got}, the parameter needs {expected[0]}")
