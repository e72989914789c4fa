"""DiLoCo whose outer sync is EDGC's compressed all-reduce (`DiLoCo`), on a plain process group.

    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    config = EDGCConfig(total_steps=inner_steps // 50, r_max=16, rank_budget=8, window=4,
                        warmup_fraction=0, min_warmup_steps=0, warmup_error_test=False)
    with DiLoCo(None, [model], inner_optimizer, outer, sync_every=50, config=config):
        for x, y in data:  # inner steps: no communication
            loss_fn(model(x), y).backward()
            inner_optimizer.step()  # every 50th: the outer step
            inner_optimizer.zero_grad()

The constructor is torchft 0.2.0's ``torchft.local_sgd.DiLoCo`` with a process group instead of a
manager, plus an `EDGCConfig` (torchft's is `edgc.integrations.torchft.DiLoCo`). Each replica takes
``sync_every`` inner steps alone; then its pseudo-gradient Δ = θ_global − θ_local is averaged over the
group and the outer optimizer (Nesterov SGD in DiLoCo) steps θ_global with the average. With
several ``model_fragments`` (Streaming DiLoCo) the fragments take turns: one every
``sync_every / fragments`` inner steps, each every ``sync_every``. With ``fragment_sync_delay`` τ > 0
a fragment's sync starts τ inner steps before its outer step and goes on while they run, as
torchft's DiLoCo does it: issued from the training thread on the jobs' side stream (`edgc.runner.jobs`),
each inner step issues what it can (`GradientReducer.progress`), and the outer step waits for the
rest, on the device (the compute stream waits for the side stream). Every collective is issued
from the one thread, in program order with the inner steps' own (FSDP or TP inside a replica).

What EDGC does with the pseudo-gradients: one `EDGCState` syncs every outer step through
``reduce_tensors``, so everything it does for gradients it does here, with outer steps as its steps:

* M = Δ + e per replica, e its error feedback; Q shared by every replica and warm-started from the
  fragment's previous outer step (names ``"<fragment>.<parameter>"`` key them);
* every step of the `EDGCConfig` is an outer step (one fragment's sync): ``total_steps`` = inner
  steps × fragments / ``sync_every``, and ``window``, the warm-up and ``rank_schedule`` count them too;
  so the byte budget (``rank_budget``) is spent over the outer steps;
* ``power_iterations=2`` runs a second power iteration on the compressed matrices (twice their
  bytes); ``edgc experiment diloco`` measures whether that pays.

A step that is not committed (torchft's integration: the manager's verdict) loses nothing: the
engine makes M the error feedback again, Q and the controller roll back, and what was sent raw
(1-D tensors; everything in uncompressed steps) is carried into the next outer step's Δ. On a plain
process group every outer step commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn, optim

from ..config import EDGCConfig
from ..device.finite import all_finite
from ..device.timing import state_to_host
from ..state import EDGCState
from ..sync.outer_sync import decay_error_feedback
from ..sync.sync_methods import sync_method, sync_method_names
from .diloco_fragment import Fragment

STATE_FORMAT = "edgc-diloco/1"
# The outer sync without an EDGCConfig: 3-bit pseudo-gradients with error feedback (a payload of
# 0.098× the raw bytes) through the two-stage all-reduce (`edgc.sync.two_stage`), whose wire stays that
# share of torchft's as the replica groups grow. Across the model families of `edgc experiment
# diloco` the 3-bit codes ended within the interval of torchft's uncompressed DiLoCo where EDGC's
# PowerSGD at rank 8 did not, nor did the sparse syncs at 0.02× the bytes or fewer, and the two-stage
# sync where the one-stage one did (docs/guides/slow-links.md).
DEFAULT_OUTER_SYNC = "quant3-2s"


class DiLoCo:
    """DiLoCo / Streaming DiLoCo with EDGC's outer sync on a plain process group (see the module docstring)."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        model_fragments: nn.Module | Sequence[nn.Module],
        inner_optimizer: optim.Optimizer,
        outer_optimizer: optim.Optimizer | Sequence[optim.Optimizer],
        sync_every: int,
        config: EDGCConfig | None = None,
        *,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        power_iterations: int = 1,
        sync_method: str | None = None,
        error_feedback_decay: float = 1.0,
    ):
        """Build the outer sync's state and agree on its settings over the group.

        The arguments but ``process_group`` and the last four are those of ``torchft.local_sgd.DiLoCo``.

        Args:
            process_group: the replicas' group (None: the default one; without an initialised one, a
                world of one).
            model_fragments: one module, or Streaming DiLoCo's fragments.
            inner_optimizer: the optimizer of the inner steps.
            outer_optimizer: the outer optimizer, one, or one per fragment.
            sync_every: inner steps per outer step.
            config: EDGC's settings (its steps are outer steps).
            backup_device: where θ_global is kept.
            pin_memory: whether θ_global is kept in pinned memory.
            fragment_sync_delay: Streaming DiLoCo's τ.
            fragment_update_alpha: Streaming DiLoCo's α.
            power_iterations: PowerSGD's power iterations, 1 or 2.
            sync_method: a registered method's name (`edgc.sync.sync_methods`) instead of EDGC's PowerSGD;
                ``config`` then goes unused; with neither, `DEFAULT_OUTER_SYNC`.
            error_feedback_decay: the error feedback is multiplied by it before every outer step's sync
                (1: kept whole).
        """
        fragments = [model_fragments] if isinstance(model_fragments, nn.Module) else list(model_fragments)
        outers = (
            list(outer_optimizer) if isinstance(outer_optimizer, (list, tuple)) else [outer_optimizer] * len(fragments)
        )
        if config is None and sync_method is None:
            sync_method = DEFAULT_OUTER_SYNC
        config = config if config is not None else EDGCConfig()
        _check(fragments, outers, sync_every, fragment_sync_delay, fragment_update_alpha, power_iterations, config)
        _check_outer_sync(sync_method, error_feedback_decay, power_iterations)
        self._sync_method, self._decay = sync_method, error_feedback_decay
        self._sync_every = sync_every // len(fragments)  # inner steps between two fragments' outer steps
        self._delay = fragment_sync_delay
        self._alpha = fragment_update_alpha
        self._inner = inner_optimizer
        self._local_step = 0
        self._hooks: list = []
        self._syncing: Fragment | None = None  # the fragment whose sync was prepared and awaits its outer step
        self._carry: dict[str, torch.Tensor] = {}  # raw-sent Δ of discarded outer steps, per parameter name
        # EDGC's engine only (`_check_outer_sync`), built with it (`LowRankConfig.power_iterations`)
        if power_iterations != 1:
            config = replace(config, engine=replace(config.engine, power_iterations=power_iterations))
        self.state = self._new_state(process_group, config, nn.ModuleList(fragments))
        # Compared over the group before the first outer sync sends anything (`edgc.distributed.agreement`): a
        # replica that syncs at other inner steps, or other fragments, would pair other collectives.
        self.state.agree_on(
            {
                "DiLoCo.sync_every": sync_every,
                "DiLoCo.fragments": [len(list(m.parameters())) for m in fragments],
                "DiLoCo.fragment_sync_delay": fragment_sync_delay,
                "DiLoCo.fragment_update_alpha": fragment_update_alpha,
                "DiLoCo.sync_method": sync_method,
                "DiLoCo.error_feedback_decay": error_feedback_decay,
            }
        )
        self._fragments = [
            Fragment(i, module, outer, backup_device, pin_memory)
            for i, (module, outer) in enumerate(zip(fragments, outers))
        ]
        self.last_outer_step: dict | None = None  # what the last outer step did (see `_record`)

    # ------------------------------------------------------------------ what subclasses change
    def _new_state(self, process_group, config: EDGCConfig, model: nn.Module) -> EDGCState:
        if self._sync_method is not None:
            return sync_method(self._sync_method).build(process_group, model=model)  # type: ignore[union-attr, return-value]
        return EDGCState(process_group, config, model=model)

    def _start_outer_step(self) -> None:
        """Called when a fragment's sync is about to start (torchft: the quorum)."""

    def _outer_index(self) -> int:
        """Outer steps committed so far; which fragment syncs next is this modulo the fragments."""
        return self.state.step

    def _should_commit(self) -> bool:
        """Whether the prepared outer step is applied (torchft: the manager's verdict)."""
        return True

    # ------------------------------------------------------------------ the inner loop's hooks
    def __enter__(self) -> DiLoCo:
        self._hooks.append(self._inner.register_step_pre_hook(self._step_pre_hook))
        self._hooks.append(self._inner.register_step_post_hook(self._step_post_hook))
        return self

    def __exit__(self, *exc: Any) -> bool:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return False

    def _step_pre_hook(self, *args: Any) -> None:
        """Before an inner step (torchft: no state may be read for a peer while the parameters change)."""

    def _step_post_hook(self, *args: Any) -> None:
        self.inner_step_done()

    def inner_step_done(self) -> None:
        """Count one inner step; prepare and take outer steps when due (the inner optimizer's hook calls this)."""
        self._local_step += 1
        if self._syncing is not None:
            self.state.progress()  # the sync in flight issues its next collectives
        if self._local_step == self._sync_every - self._delay:
            self._start_outer_step()
            self._prepare(self._fragments[self._outer_index() % len(self._fragments)])
        if self._local_step == self._sync_every:
            self._perform()
            self._local_step = 0

    # ------------------------------------------------------------------ one outer step
    @torch.no_grad()
    def _prepare(self, fragment: Fragment) -> None:
        """Δ = θ_global − θ_local (+ what a discarded step could not keep), and start its sync."""
        deltas = fragment.pseudo_gradients()
        for name, delta in zip(fragment.names, deltas):
            carried = self._carry.pop(name, None) if self._carry else None
            if carried is not None:
                delta += carried.to(delta.device, delta.dtype, non_blocking=True)
        fragment.copied()
        fragment.deltas = deltas
        decay_error_feedback(self.state, self._decay)  # the owners' part of a two-stage sync's too
        # A state that leaves the whole M in its error feedback on a rollback (`edgc.sync.two_stage`) needs
        # no copy of Δ to carry: 4 bytes a parameter fewer while the verdict is out.
        keeps = self.state.rollback_keeps_input
        fragment.kept = [d.clone() for d in deltas] if self.state.defer_commit and not keeps else []
        self._syncing = fragment
        self.state.reduce_tensors(fragment.names, fragment.deltas, last=False, blocking=False)

    @torch.no_grad()
    def _perform(self) -> None:
        """The outer step: wait for the sync, back to θ_global, and, if committed, the outer optimizer's step."""
        fragment, self._syncing = self._syncing, None
        assert fragment is not None, "an outer step without its sync: the inner step count went wrong"
        self.state.reduce_tensors([], [], last=True)  # the rest of the sync; the compute stream waits for it
        local = [p.detach().clone() for p in fragment.params] if self._alpha > 0 else []
        fragment.restore()
        committed = self._should_commit()
        if committed:
            fragment.outer_optimizer.zero_grad()  # an optimizer shared by fragments steps only this one's
            for p, delta in zip(fragment.params, fragment.deltas):
                p.grad = delta.to(p.dtype)
            fragment.outer_optimizer.step()
            fragment.save()
            for p, mine in zip(fragment.params, local):
                p.lerp_(mine, self._alpha)
        else:
            self._carry_raw(fragment)
        fragment.outer_optimizer.zero_grad()
        self._record(fragment, committed)
        fragment.deltas, fragment.kept = [], []

    def _carry_raw(self, fragment: Fragment) -> None:
        """A discarded step: the engine made M the error feedback of the compressed matrices; what was
        sent raw is carried into the next Δ (dropped where not finite, as M is)."""
        ranks = self.state.last_step_metrics.get("ranks", {})
        for name, sent in zip(fragment.names, fragment.kept):
            if not ranks.get(name):
                self._carry[name] = sent.masked_fill(~all_finite(sent), 0)  # on the device: no host read

    def _record(self, fragment: Fragment, committed: bool) -> None:
        metrics = self.state.last_step_metrics
        self.last_outer_step = {
            "fragment": fragment.index,
            "committed": committed,
            "method": self._sync_method or "edgc",
            "phase": metrics.get("phase"),
            "rank": metrics.get("rank"),
            "bytes_sent": metrics.get("bytes_sent"),
            "payload_bytes": metrics.get("payload_bytes", metrics.get("bytes_sent")),  # what the messages hold
            "bytes_raw": metrics.get("bytes_raw"),
            "relative_error": metrics.get("relative_error"),
            "nonfinite": metrics.get("nonfinite"),
        }

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Everything DiLoCo keeps beyond the model and the inner optimizer (which the caller saves):
        θ_global and outer optimizer per fragment, the inner step count, the carried Δ and this
        replica's whole EDGC state (error feedback included).

        Returns:
            The state, for `load_state_dict`.

        Raises:
            RuntimeError: an overlapped outer sync is in flight (``fragment_sync_delay``).
        """
        if self._syncing is not None:
            raise RuntimeError(
                "DiLoCo.state_dict(): a fragment's outer sync is in flight (fragment_sync_delay); "
                "take the checkpoint at another inner step"
            )
        return {
            "format": STATE_FORMAT,
            "local_step": self._local_step,
            "carry": state_to_host(self._carry),
            "fragments": [f.state_dict() for f in self._fragments],
            "edgc": self.state.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned.

        Args:
            state: a state `state_dict` returned, by a DiLoCo with as many fragments.

        Raises:
            ValueError: ``state`` is not a DiLoCo state, or holds another number of fragments.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a DiLoCo state (expected format {STATE_FORMAT!r})")
        if len(state["fragments"]) != len(self._fragments):
            raise ValueError(f"DiLoCo state has {len(state['fragments'])} fragments, this one {len(self._fragments)}")
        self.state.load_state_dict(state["edgc"])
        for fragment, saved in zip(self._fragments, state["fragments"]):
            fragment.load_state_dict(saved)
        self._local_step = int(state["local_step"])
        self._carry = {name: t.clone() for name, t in state["carry"].items()}


def _check(
    fragments: list, outers: list, sync_every: int, delay: int, alpha: float, iterations: int, config: EDGCConfig
) -> None:
    """One clear line for each argument that cannot work."""
    if not fragments or not all(isinstance(m, nn.Module) for m in fragments):
        raise ValueError("DiLoCo: model_fragments must be one nn.Module or a non-empty list of them")
    if len(outers) != len(fragments):
        raise ValueError(
            f"DiLoCo: {len(outers)} outer optimizers for {len(fragments)} fragments (give one, or one each)"
        )
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < len(fragments):
        raise ValueError(
            f"DiLoCo: sync_every must be an integer ≥ the number of fragments ({len(fragments)}), got {sync_every!r}"
        )
    if sync_every % len(fragments):
        raise ValueError(
            f"DiLoCo: sync_every ({sync_every}) must be a multiple of the number of fragments ({len(fragments)})"
        )
    if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < sync_every // len(fragments):
        raise ValueError(
            f"DiLoCo: fragment_sync_delay must be an integer in [0, sync_every / fragments = "
            f"{sync_every // len(fragments)}), got {delay!r}"
        )
    if not 0 <= alpha <= 1:
        raise ValueError(f"DiLoCo: fragment_update_alpha must be in [0, 1], got {alpha!r}")
    if iterations not in (1, 2):
        raise ValueError(f"DiLoCo: power_iterations must be 1 or 2, got {iterations!r}")
    if iterations == 2 and not config.engine.error_feedback:
        raise ValueError(
            "DiLoCo: power_iterations=2 needs EDGCConfig.engine.error_feedback (the second iteration reads M from it)"
        )
    names = [id(p) for m in fragments for p in m.parameters()]
    if len(names) != len(set(names)):
        raise ValueError("DiLoCo: a parameter is in more than one fragment")


def _check_outer_sync(method: str | None, decay: float, iterations: int) -> None:
    if method is not None and sync_method(method) is None:
        raise ValueError(f"DiLoCo: sync_method {method!r} is not registered (one of {', '.join(sync_method_names())})")
    if method is not None and iterations != 1:
        raise ValueError("DiLoCo: power_iterations applies to EDGC's PowerSGD, not to a sync_method")
    if not 0 <= decay <= 1:
        raise ValueError(f"DiLoCo: error_feedback_decay must be in [0, 1], got {decay!r}")
