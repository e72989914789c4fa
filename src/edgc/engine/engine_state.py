"""What the PowerSGD engine keeps between steps, and how a step's changes are kept or undone.

Per parameter name: the warm-start Q (n × r, identical on every rank) and this rank's error
feedback e (m × n). Per call layout (`CallState`): the *arena* whose (m, n) views are the error
feedback of the call's compressed matrices (M = G + e is formed in place, one batched add per
shape group), the flat Qᵀ buffer of the last step (the next step reads it as is: no copy, no
allocation), and the rows that restart a Q row that collapsed to zero.

``q`` and ``error`` are plain dicts the engine keeps pointing into those buffers; anything that
replaces an entry (a checkpoint, a rank change) breaks the match, and the next call of that layout
rebuilds its buffers from the dicts. So the dicts are always the truth, and the buffers a cache.

A step's changes (`begin_step` … `end_step` / `commit` / `rollback`): after a non-finite step the
error feedback it touched is cleared (M = G + e was formed in place before anyone knew of the
NaN/Inf, and with a GradScaler the kept residual would come back at twice its size) and Q factors
resized for a new rank get their old shape back. With ``uncommitted=True`` the residual goes to a
second arena so that M survives: `commit` keeps the residual, `rollback` makes M the error
feedback again (zeroing the matrices whose M is not finite).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..adapters import torch_adapter
from ..config import LowRankConfig
from ..device import streams
from ..device.timing import state_to_device, state_to_host, to_device
from .factors import matrix_shape, orthonormalize_blocks_, restart_dead_entries_, stable_seed
from .layout import CallLayout


@dataclass
class CallState:
    """The buffers kept for one call layout (see the module docstring)."""

    layout: CallLayout
    shapes: tuple  # the tensor shapes the layout was planned for
    arena: torch.Tensor | None = None  # error feedback of the compressed matrices (M during a step)
    error_views: list[torch.Tensor] = field(default_factory=list)  # (m, n) views of arena, layout order
    spare: torch.Tensor | None = None  # uncommitted steps: the arena the residual goes to
    q_flat: torch.Tensor | None = None  # the last step's Qᵀ buffer
    q_views: list[torch.Tensor] = field(default_factory=list)  # (n, r) views of q_flat, layout order
    replacement: torch.Tensor | None = None  # rows that restart zero rows of Q: (r, n) per Q block

    def views(self, arena: torch.Tensor) -> list[torch.Tensor]:
        return [block for group in self.layout.groups for block in group.error_view(arena).unbind(0)]


def subtracts_estimate(cpu_kernels: bool, estimate_in_arena_dtype: bool) -> bool:
    """Whether a call forms its residual as e = M − Ĝ from the Ĝ just written rather than as a second
    rank-r product: on a CPU (and not counting the accelerator's kernels there) an element-wise pass
    is cheaper than that product, and exact where Ĝ has the arena's dtype. An accelerator keeps the
    product, which never reads Ĝ back (the fewest bytes). The simulator asks this too."""
    return cpu_kernels and estimate_in_arena_dtype


def _still_kept(
    buffer: torch.Tensor | None,
    views: list[torch.Tensor],
    store: dict[str, torch.Tensor],
    names: list[str],
    dtype: torch.dtype,
    device: torch.device,
) -> bool:
    """Whether a call's buffer still holds what ``store`` says: every name maps to its view in it."""
    return (
        buffer is not None
        and buffer.dtype == dtype
        and buffer.device == device
        and len(views) == len(names)
        and all(store.get(name) is view for name, view in zip(names, views))
    )


class EngineState:
    """The engine's state and its step protocol (see the module docstring); the
    `edgc.engine.lowrank.LowRankCompressor` that holds it (``compressor.state``) computes on it.
    ``config``: the engine's `LowRankConfig`."""

    def __init__(self, config: LowRankConfig):
        self.config = config
        self.q: dict[str, torch.Tensor] = {}  # name → (n, r), identical on every rank
        self.error: dict[str, torch.Tensor] = {}  # name → (m, n), this rank's residual
        self.shapes: dict[str, tuple[int, int]] = {}  # name → (m, n) of every matrix seen
        self.shares: dict[
            str, int
        ] = {}  # name → its own rank where a rank split gives it one (`edgc.policies.rank_split`)
        self.orthonormalization: str | None = None  # the group's method (`edgc.engine.orthonormal_choice`), once chosen
        self.keep_uncommitted = False
        self._calls: dict[tuple, CallState] = {}
        self._tracking = False  # between begin_step and the step's resolution
        self._touched: list[torch.Tensor] = []  # arenas whose error feedback this step wrote
        self._resized: dict[str, torch.Tensor] = {}  # Q factors as they were before this step resized them
        self._q_stored: list[tuple[CallState, torch.Tensor]] = []  # (call, its Q before this step)
        self._step_arenas: list[tuple[CallState, torch.Tensor]] = []  # uncommitted: (call, its M arena)
        self._step_popped: dict[str, torch.Tensor] = {}  # error feedback moved into raw-sent gradients

    # ------------------------------------------------------------------ the step protocol
    def begin_step(self, *, uncommitted: bool = False) -> None:
        """Track what the coming step changes, for `end_step`, `commit` and `rollback`."""
        self.keep_uncommitted = uncommitted
        self._tracking = True
        self._touched, self._resized, self._step_arenas, self._step_popped = [], {}, [], {}
        self._q_stored = []

    def end_step(self, nonfinite: bool) -> None:
        """The step's non-finite flag is known (on the host, at its end): after a non-finite step clear
        the error feedback it touched and give resized Q factors their old shape back. Q is kept."""
        if nonfinite:
            for arena in self._touched:
                arena.zero_()
            for call, q_stored in reversed(self._q_stored):  # the earliest last: a Q from before the step
                self._keep_q(call, q_stored)
            self.q.update(self._resized)
        self._touched, self._resized, self._q_stored = [], {}, []
        if not self.keep_uncommitted:
            self._tracking = False

    def commit(self) -> None:
        """The uncommitted step is applied: its residuals stay the error feedback; its M arenas become spares."""
        for call, m_arena in self._step_arenas:
            call.spare = m_arena
        self._step_arenas, self._step_popped, self._tracking = [], {}, False

    def rollback(self) -> None:
        """The uncommitted step is discarded: the error feedback becomes M = G + e of the step again, so
        nothing of its gradient is lost, and error feedback moved into raw-sent gradients comes back.
        An M that holds a NaN/Inf (this replica's gradient was not finite) cannot be kept: that
        matrix is zeroed, as a non-finite step's residual is."""
        for call, m_arena in self._step_arenas:
            for group in call.layout.groups:
                block = group.error_view(m_arena)
                finite = torch.isfinite(block).flatten(1).all(1)
                block.masked_fill_(~finite.view(-1, 1, 1), 0.0)
            call.spare = call.arena
            self._use_arena(call, m_arena)
        self.error.update(self._step_popped)
        self._step_arenas, self._step_popped, self._tracking = [], {}, False

    def snapshot(self) -> dict:
        """The shared state (Q) as it is now, cheaply: Q buffers are replaced every step, never
        written in place, so references suffice (`restore`)."""
        return {"q": dict(self.q), "calls": {key: (c.q_flat, c.q_views) for key, c in self._calls.items()}}

    def restore(self, snapshot: dict) -> None:
        self.q = dict(snapshot["q"])
        for key, (q_flat, q_views) in snapshot["calls"].items():
            if key in self._calls:
                self._calls[key].q_flat, self._calls[key].q_views = q_flat, q_views

    def drop_error(self) -> None:
        """Forget every residual (they are per rank: a new world size cannot split or merge them)."""
        self.error.clear()
        for call in self._calls.values():
            call.arena, call.spare, call.error_views = None, None, []

    def note_resized(self, previous: dict[str, torch.Tensor]) -> None:
        if self._tracking:
            for name, q in previous.items():
                self._resized.setdefault(name, q)

    # ------------------------------------------------------------------ per-call buffers
    def open_call(
        self, names: list[str], grads: list[torch.Tensor], rank: int, compute: torch.dtype, method: str
    ) -> tuple[CallState, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A call of the engine begins: (its kept buffers, M = G + e in its arena, the stored Qᵀ, the
        warm-started Qᵀ; both None where it compresses nothing). A matrix sent raw now (after a rank
        change) takes its pending residual along. ``compute``: the dtype of M and the factors;
        ``method``: the orthonormalisation's (`edgc.engine.factors`)."""
        call = self._call_state(names, grads, rank)
        self._flush_into_raw(call.layout, grads)
        arena = self._form_m(call, grads, compute)
        q_stored = q_in = None
        if call.layout.groups:
            q_stored, q_in = self._warm_start(call, grads[0].device, compute, method)
        return call, arena, q_stored, q_in

    def close_call(
        self,
        call: CallState,
        arena: torch.Tensor,
        factors: list[tuple[torch.Tensor, torch.Tensor]] | list[list[torch.Tensor]] | None,
        q_stored: torch.Tensor,
        q_flat: torch.Tensor,
        nonfinite: torch.Tensor,
    ) -> None:
        """A call ends: with error feedback, e = M − P·Qᵀ from ``factors`` (per shape group (Pᵀ, Qᵀ) in
        the arena's dtype); the call's Q is the averaged ``q_flat``, or the stored one where the
        group saw a NaN/Inf (``nonfinite``, a device flag). Within a tracked step the averaged one is kept
        and `end_step` puts the stored one back after a non-finite step (no select over Q on the device:
        Q buffers are replaced, never written, so keeping the stored one's reference costs nothing);
        outside one, the select runs on the device."""
        if factors is not None:
            self._keep_residual(call, arena, factors)
        if self._tracking:
            self._q_stored.append((call, q_stored))
            self._keep_q(call, q_flat)
        else:
            self._keep_q(call, torch.where(nonfinite, q_stored, q_flat))

    def rank_for(self, name: str, rank: int) -> int:
        """The rank ``name`` is compressed at when the step's rank is ``rank`` (its share, if it has one)."""
        return self.shares.get(name, rank)

    def _call_state(self, names: list[str], grads: list[torch.Tensor], rank: int) -> CallState:
        key = (tuple(names), rank, tuple(self.shares.get(name, 0) for name in names) if self.shares else ())
        shapes = tuple(tuple(g.shape) for g in grads)
        call = self._calls.get(key)
        if call is None or call.shapes != shapes:
            # A new layout for these names (a rank change, DDP's bucket rebuild): drop the old ones'
            # buffers, whose values live on in the dicts until this call's rebuild copies them.
            overlap = set(names)
            for other in [k for k in self._calls if overlap.intersection(k[0])]:
                del self._calls[other]
            call = self._calls[key] = CallState(
                CallLayout.plan(names, grads, rank, self.config.min_compression_rate, self.shares), shapes
            )
            for name, grad in zip(names, grads):
                if (shape := matrix_shape(grad)) is not None:
                    self.shapes[name] = shape
        return call

    def _flush_into_raw(self, layout: CallLayout, grads: list[torch.Tensor]) -> None:
        """A matrix sent raw now (after a rank change) takes its pending residual with it."""
        for i in layout.raw:
            pending = self.error.pop(layout.names[i], None)
            if pending is not None:
                grads[i].add_(pending.view_as(grads[i]).to(grads[i].dtype))
                if self.keep_uncommitted:
                    self._step_popped[layout.names[i]] = pending

    def _form_m(self, call: CallState, grads: list[torch.Tensor], compute: torch.dtype) -> torch.Tensor:
        """M = G + e of every compressed matrix, in the arena, added from each gradient where it lies:
        no gathered copy of the gradients, so a pass reads G once and e once and writes M once (one
        ``_foreach_add_``: one multi-tensor kernel where G and e share a dtype, one kernel per matrix
        where they do not). Without error feedback, M is G copied into a scratch arena of the
        compute dtype (one ``_foreach_copy_``, which casts within its one kernel)."""
        layout = call.layout
        ordered = [grads[i].view(group.m, group.n) for group in layout.groups for i in group.indices]
        if not self.config.error_feedback:
            scratch = torch.empty(layout.error_numel, dtype=compute, device=grads[0].device)
            if ordered:
                torch._foreach_copy_(call.views(scratch), ordered)
            return scratch
        error_dtype = grads[0].dtype if self.config.error_feedback_dtype == "gradient" else compute
        if not self._arena_intact(call, error_dtype, grads[0].device):
            self._rebuild_arena(call, error_dtype, grads[0].device)
        if ordered:
            torch._foreach_add_(call.error_views, ordered)
        if self._tracking and not self.keep_uncommitted:
            self._touched.append(call.arena)
        return call.arena

    def _arena_intact(self, call: CallState, dtype: torch.dtype, device: torch.device) -> bool:
        return _still_kept(call.arena, call.error_views, self.error, call.layout.compressed_names, dtype, device)

    def _rebuild_arena(self, call: CallState, dtype: torch.dtype, device: torch.device) -> None:
        """The arena from the error dict (a first step, a checkpoint, a rank change): zeros where a
        matrix has no residual yet. Where the dict's entries already lie in one buffer exactly where
        this layout places them (a rank change that keeps the compressed matrices, their order and so
        their shape groups' places), that buffer is the arena: rebuilt in place, no second arena
        alive beside the old one, nothing copied."""
        arena = self._arena_in_place(call, dtype, device)
        if arena is None:
            arena = torch.zeros(call.layout.error_numel, dtype=dtype, device=device)
            for name, view in zip(call.layout.compressed_names, call.views(arena)):
                old = self.error.get(name)
                if old is not None and old.numel() == view.numel():
                    view.copy_(old.reshape(view.shape))
        call.spare = None
        self._use_arena(call, arena)

    def _arena_in_place(self, call: CallState, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        names = call.layout.compressed_names
        base = torch_adapter.view_base(self.error.get(names[0])) if names else None
        if (
            base is None
            or base.dim() != 1
            or base.numel() != call.layout.error_numel
            or base.dtype != dtype
            or base.device != device
        ):
            return None
        for name, view in zip(names, call.views(base)):
            kept = self.error.get(name)
            if kept is None or torch_adapter.view_base(kept) is not base:
                return None
            if kept.storage_offset() != view.storage_offset() or kept.shape != view.shape:
                return None
        return base

    def _use_arena(self, call: CallState, arena: torch.Tensor) -> None:
        call.arena = arena
        call.error_views = call.views(arena)
        self.error.update(zip(call.layout.compressed_names, call.error_views))

    def _keep_residual(
        self,
        call: CallState,
        arena: torch.Tensor,
        factors: list[tuple[torch.Tensor, torch.Tensor]] | list[list[torch.Tensor]],
    ) -> None:
        """e = M − P·Qᵀ for the whole call, one batched product per shape group that reads M and
        writes e (``baddbmm``, β = 1, α = −1): Ĝ is never read back. ``factors``: per group (Pᵀ, Qᵀ)
        in the arena's dtype, or the group's Ĝ matrices in that dtype (e = M − Ĝ, a CPU's choice:
        `subtracts_estimate`). Over M in place, or (uncommitted) into the spare
        arena, M left intact for a rollback."""
        residual = arena
        if self.keep_uncommitted:
            residual = call.spare
            if residual is None or residual.shape != arena.shape or residual.dtype != arena.dtype:
                residual = torch.empty_like(arena)
        for group, factor in zip(call.layout.groups, factors):
            if isinstance(factor, list):  # Ĝ's matrices: e = M − Ĝ, one element-wise pass each
                for m, estimate, e in zip(group.error_view(arena), factor, group.error_view(residual)):
                    torch.sub(m, estimate, out=e)
            else:
                p_t, q_t = factor
                torch.baddbmm(
                    group.error_view(arena), p_t.transpose(1, 2), q_t, alpha=-1, out=group.error_view(residual)
                )
        if not self.keep_uncommitted:
            return
        call.spare = None
        self._step_arenas.append((call, arena))
        self._touched.append(residual)  # a non-finite step clears the residual, never M
        self._use_arena(call, residual)

    # ------------------------------------------------------------------ Q
    def _warm_start(
        self, call: CallState, device: torch.device, compute: torch.dtype, method: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(stored Qᵀ, Qᵀ with rows orthonormalised and dead rows restarted) of the call's matrices,
        laid out as its Q buffer.

        Orthonormal rather than merely scaled: P = M·Q then has M's condition number, not M's times
        Q's (Q = Mᵀ·P carries the singular values, so its own condition number grows with their
        spread, and float32 would lose P's weak directions). A zero row (a layer without gradient,
        a rank-deficient M: the orthonormalisation keeps it zero) or the NaN rows of a failed
        factorisation restart from the replacement rows (`restart_dead_entries_`), so a Q that
        cannot be orthonormalised does not stall the power iteration step after step."""
        source = call.q_flat if self._q_intact(call, compute, device) else self._gather_q(call, device, compute)
        if call.replacement is None or call.replacement.device != device or call.replacement.dtype != compute:
            call.replacement = self._replacement_rows(call, device, compute)
        q_in = orthonormalize_blocks_(
            source,
            call.layout.q_blocks,
            self.config.orthogonalization_epsilon,
            method=method,
            out=torch.empty_like(source),
        )
        restart_dead_entries_(q_in, call.layout.q_blocks, call.replacement)
        return source, q_in

    def _q_intact(self, call: CallState, dtype: torch.dtype, device: torch.device) -> bool:
        return _still_kept(call.q_flat, call.q_views, self.q, call.layout.compressed_names, dtype, device)

    def _gather_q(self, call: CallState, device: torch.device, compute: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(call.layout.q_numel, device=device, dtype=compute)
        for group in call.layout.groups:
            stored = [self.q.get(name) for name in group.names]
            self.note_resized({n: q for n, q in zip(group.names, stored) if q is not None and q.shape[1] != group.rank})
            columns = [self.resized_q(name, group.n, group.rank, device).to(compute).T for name in group.names]
            group.q_view(buffer).copy_(torch.stack(columns))
        return buffer

    def resized_q(self, name: str, n: int, rank: int, device: torch.device) -> torch.Tensor:
        """This parameter's warm-start Q (``n`` = its column count) with exactly ``rank`` columns: the
        first ``rank`` of the stored ones, or those followed by columns drawn from a generator seeded
        by (seed, name, old rank, new rank); a seeded draw where none is stored (`edgc.engine.rank_change`)."""
        q = self.q.get(name)
        if q is not None and q.shape[0] != n:
            q = None  # the parameter changed shape: start over
        if q is None:
            generator = torch.Generator().manual_seed(stable_seed(self.config.seed, name))
            q = to_device(torch.randn(n, rank, generator=generator), device)
        elif q.shape[1] > rank:
            q = q[:, :rank]
        elif q.shape[1] < rank:
            generator = torch.Generator().manual_seed(stable_seed(self.config.seed, name, q.shape[1], rank))
            extra = to_device(torch.randn(n, rank - q.shape[1], generator=generator), device)
            q = torch.cat([q, extra], dim=1)
        return q

    def _replacement_rows(self, call: CallState, device: torch.device, compute: torch.dtype) -> torch.Tensor:
        """Unit rows, one (r, n) set per Q block, shared by its matrices: a restarted direction only has
        to be non-zero and the same on every process, so it need not cost a second Q of memory."""
        drawn = []
        for block in call.layout.q_blocks:
            generator = torch.Generator().manual_seed(stable_seed(self.config.seed, "reseed", block.rank, block.side))
            rows = torch.randn(block.rank, block.side, generator=generator, dtype=torch.float64)
            drawn.append((rows / rows.norm(dim=1, keepdim=True)).reshape(-1))
        rows = torch.cat(drawn) if drawn else torch.empty(0, dtype=torch.float64)
        return to_device(rows.to(compute), device)

    def _keep_q(self, call: CallState, q_flat: torch.Tensor) -> None:
        call.q_flat = q_flat
        call.q_views = [q.T for group in call.layout.groups for q in group.q_view(q_flat).unbind(0)]
        self.q.update(zip(call.layout.compressed_names, call.q_views))

    def state_bytes(self) -> int:
        """Device bytes the engine keeps between steps: error feedback, Q, restart rows (and the spare
        arena of uncommitted steps)."""
        buffers = {
            id(t): t for c in self._calls.values() for t in (c.arena, c.spare, c.q_flat, c.replacement) if t is not None
        }
        kept = {id(t.untyped_storage()) for t in buffers.values()}
        loose = [t for t in (*self.q.values(), *self.error.values()) if id(t.untyped_storage()) not in kept]
        return sum(t.numel() * t.element_size() for t in (*buffers.values(), *loose))

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self, *, include_error: bool = True) -> dict:
        """Q, error feedback (unless ``include_error`` is False: the part every replica shares) and the
        matrix shapes (for a rank change after a resume), on the CPU: a checkpoint, where the host
        waits for the device."""
        return {
            "q": state_to_host(self.q),
            "error": state_to_host(self.error) if include_error else {},
            "shapes": {name: list(shape) for name, shape in self.shapes.items()},
            "orthonormalization": self.orthonormalization,
        }

    def load_state_dict(self, state: dict, *, keep_error: bool = False) -> None:
        """A checkpoint's or a peer's state (``keep_error``: this rank's error feedback stays, as a healing
        replica keeps its own). Its orthonormalisation, where it has one, is the group's (a resumed or
        healed replica times nothing); else the one chosen so far stays."""
        self.q = dict(state["q"])
        self.error = self.error if keep_error else dict(state["error"])
        self.shapes = {name: (int(m), int(n)) for name, (m, n) in state.get("shapes", {}).items()}
        self.orthonormalization = state.get("orthonormalization") or self.orthonormalization
        self._calls.clear()
        self.begin_step()
        self._tracking = False

    def to(self, device: torch.device, stream: streams.Stream | None = None) -> None:
        """Q and error feedback onto ``device`` for ``stream``, the jobs' stream that reads and replaces
        them (`edgc.device.timing.state_to_device`)."""
        self.q = state_to_device(self.q, device, stream)
        self.error = state_to_device(self.error, device, stream)
        self._calls.clear()
