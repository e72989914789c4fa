"""`ErrorFeedback`: the one error feedback of the library, held by every method that keeps one (the sync
methods, the two-stage all-reduce's senders and owners, the PowerSGD engine, the inter-stage compressor).

Error feedback: e ← M − what was sent, where M = G + e is this rank's corrected gradient; e is added to
the next step's gradient, so what compression dropped is sent later, nothing lost. The table holds e
per key (a parameter's name, a call's first name, a micro-batch slot); what a method computes with it
is the method's, what is kept between steps is here:

* **the table** (``table``), and where a method reads and writes a call's entries whole, one flat
  buffer per call whose entries are views of it (`flat`, `FlatErrors`): decay, heal and checkpoints
  change the views in place, the call reads the buffer with no per-entry launch;
* **entries tied to a layout** (`tied`, ``layouts``): an entry that belongs to a partition of the
  group (the chunks a two-stage owner owns) is dropped, with the owner's line, when another partition
  asks for it, and at a heal (no other rank holds it);
* **rollback** (``rollback``, one of `ROLLBACK_MODES`): what a discarded step (torchft's verdict)
  leaves: ``keep`` — e as the step left it; ``restore`` — e from before the step (`snapshot`,
  `restore`: references, nothing copied); ``resend`` — e becomes the step's whole M again, undone by
  the method, which alone knows what it sent (the engine's second arena, the two-stage messages);
* `decay` (DiLoCo's e ← f · e; ``-noef`` is f = 0), `drop` (a heal, a new world size), `to` (a device
  move for the stream that reads it), and `state_dict` / `load_state_dict` in one format:
  ``{"error": {key: tensor}}``, with ``"layouts": {key: [values]}`` for tied entries. `load_state_dict`
  reads each earlier format too (`converted`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterator, MutableMapping
from typing import Any

import torch

from ..device import streams
from ..device.timing import state_to_device, state_to_host

ROLLBACK_MODES = ("keep", "restore", "resend")


def views_intact(buffer, views: list, table: dict, names: list, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a flat buffer still holds what ``table`` says: every name maps to its view in it (a load, a
    device move, an entry set by hand breaks the match).

    Args:
        buffer: the flat buffer, or None.
        views: its entries' views, in ``names``' order.
        table: key → tensor.
        names: the keys.
        dtype: the dtype it must have.
        device: the device it must be on.

    Returns:
        True when the buffer is still the table's.
    """
    return (
        buffer is not None
        and buffer.dtype == dtype
        and buffer.device == device
        and len(views) == len(names)
        and all(table.get(name) is view for name, view in zip(names, views))
    )


def fill_views(table: dict, names: list, views: list[torch.Tensor]) -> None:
    """Copy each entry ``table`` holds into its view of a new buffer (left zero where it holds none, or
    one of another size); the caller then makes the views the entries.

    Args:
        table: key → tensor.
        names: the keys.
        views: their views in the new buffer.
    """
    for name, view in zip(names, views):
        old = table.get(name)
        if old is not None and old.numel() == view.numel():
            view.copy_(old.reshape(view.shape))


class FlatErrors:
    """The flat storage of an error feedback: each call's entries (keyed by its first name) as one flat
    buffer, the table holding views of it. An entry the table no longer holds as its view (a load, a
    move to the device, an entry set by hand) is copied into a new buffer at the call's next use."""

    def __init__(self):
        self._flat: dict[Hashable, tuple[tuple, list[torch.Tensor], torch.Tensor]] = {}

    def of(self, table: dict, names: list, grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The flat error feedback of the call of ``names``.

        Args:
            table: the error feedback's table, whose entries become views of the buffer.
            names: the call's keys, in its order.
            grads: the call's tensors (their shapes and device).
            dtype: the buffer's dtype.

        Returns:
            The buffer, ``table``'s entries its views (zero where ``table`` held none).
        """
        key, device = names[0], grads[0].device
        kept_names, views, flat = self._flat.get(key, ((), [], None))
        if kept_names == tuple(names) and views_intact(flat, views, table, names, dtype, device):
            if all(v.shape == g.shape for v, g in zip(views, grads)):
                return flat
        flat = torch.zeros(sum(g.numel() for g in grads), dtype=dtype, device=device)
        views = [part.view(g.shape) for part, g in zip(flat.split([g.numel() for g in grads]), grads)]
        fill_views(table, names, views)
        table.update(zip(names, views))
        self._flat[key] = (tuple(names), views, flat)
        return flat

    def clear(self) -> None:
        """Forget the buffers (the table's entries stay, copied into new ones at their call's next use)."""
        self._flat.clear()


class ErrorFeedback:
    """One error feedback (see the module docstring).

    Args:
        enabled: keep what a sync did not carry for the next (False: the table stays empty).
        rollback: what a discarded step leaves, one of `ROLLBACK_MODES`.
        layout: for entries tied to a layout: rebuilds a layout from the values its checkpoint holds
            (None: entries are not tied).
    """

    def __init__(self, enabled: bool = True, *, rollback: str = "keep", layout: Callable[[list], Any] | None = None):
        if rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback: one of {', '.join(ROLLBACK_MODES)}, got {rollback!r}")
        self.enabled, self.rollback, self._layout = bool(enabled), rollback, layout
        self.table: dict[Hashable, torch.Tensor] = {}  # key → this rank's residual
        self.layouts: dict[Hashable, Any] = {}  # key → the layout its entry belongs to (tied entries)
        self._flat = FlatErrors()

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The entry of ``key``.

        Args:
            key: its key.

        Returns:
            The state's own tensor, or None (none kept, or error feedback off).
        """
        return self.table.get(key) if self.enabled else None

    def flat(self, names: list, grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The call's entries as one flat buffer (`FlatErrors.of`).

        Args:
            names: the call's keys.
            grads: its tensors.
            dtype: the buffer's dtype.

        Returns:
            The buffer, the table's entries its views.
        """
        return self._flat.of(self.table, names, grads, dtype)

    def keep_split(self, names: list, grads: list[torch.Tensor], residual: torch.Tensor) -> None:
        """e ← ``residual``, the call's flat M − sent, cut into an entry per tensor (a copy each).

        Args:
            names: the call's keys.
            grads: its tensors (the entries' shapes).
            residual: flat, the tensors end to end.
        """
        if self.enabled:
            offset = 0
            for name, g in zip(names, grads):
                self.table[name] = residual[offset : offset + g.numel()].view(g.shape).clone()
                offset += g.numel()

    def tied(self, key: Hashable, layout: Any, make: Callable[[], torch.Tensor], *, fresh: bool, changed) -> tuple:
        """The entry of ``key`` for ``layout``: dropped where it belongs to another one.

        Args:
            key: its key.
            layout: the layout asking (a partition of the group).
            make: a new zero entry.
            fresh: the step may be rolled back: it writes a new tensor, the kept one stays for `restore`.
            changed: called with (the old layout, ``layout``) when an entry is dropped: its line.

        Returns:
            (the entry the call reads, the tensor it writes): (None, None) when error feedback is off.
        """
        if not self.enabled:
            return None, None
        kept = self.table.get(key)
        if kept is not None and self.layouts.get(key) != layout:
            changed(self.layouts.get(key), layout)
            kept = None
        current = make() if kept is None else kept
        written = torch.empty_like(current) if fresh else current
        self.table[key], self.layouts[key] = written, layout
        return current, written

    def by_layout(self) -> MutableMapping:
        """The tied entries as key → (layout, tensor), a live view: setting one sets both."""
        return _Tied(self)

    # ------------------------------------------------------------------ a step discarded
    def snapshot(self) -> dict | None:
        """What `restore` puts back (``rollback == "restore"``: references, nothing copied; else None)."""
        if self.rollback != "restore":
            return None
        return {"table": dict(self.table), "layouts": dict(self.layouts)}

    def restore(self, snapshot: dict | None) -> None:
        """The error feedback of `snapshot` again (nothing for None).

        Args:
            snapshot: `snapshot`'s.
        """
        if snapshot is not None:
            self.table, self.layouts = dict(snapshot["table"]), dict(snapshot["layouts"])
            self._flat.clear()

    # ------------------------------------------------------------------ decay, heal, device
    @torch.no_grad()
    def decay(self, factor: float) -> None:
        """e ← ``factor`` · e, every entry in place (1: unchanged; 0: error feedback off from here).

        Args:
            factor: the decay.
        """
        if factor != 1.0:
            for e in self.table.values():
                e.mul_(factor)

    def drop(self, said: Callable[[], None] | None = None) -> None:
        """Forget every entry (a heal, a new world size: residuals are per rank).

        Args:
            said: the owner's line on the ``edgc`` logger, called when there was something to drop.
        """
        if self.table and said is not None:
            said()
        self.table, self.layouts = {}, {}
        self._flat.clear()

    def to(self, device: torch.device, stream: streams.Stream | None = None) -> None:
        """Every entry onto ``device`` for ``stream``, the stream that reads and replaces them
        (`edgc.device.timing.state_to_device`).

        Args:
            device: the gradients'.
            stream: the jobs' stream (None: the current one).
        """
        self.table = state_to_device(self.table, device, stream)
        self._flat.clear()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The table on the host, in the one format.

        Returns:
            ``{"error": {key: tensor}}``, and ``"layouts": {key: [values]}`` for tied entries.
        """
        state: dict = {"error": state_to_host(self.table)}
        if self._layout is not None:
            state["layouts"] = {key: list(dataclasses.astuple(layout)) for key, layout in self.layouts.items()}
        return state

    def load_state_dict(
        self, state: Any, *, shapes: dict | None = None, what: str = "error feedback", key: Callable = lambda k: k
    ) -> None:
        """Load `state_dict`'s format or an earlier one (`converted`), on the host until `to`.

        Args:
            state: the saved error feedback.
            shapes: key → the shape each entry must have (None or empty: not checked).
            what: the owner's name, for the messages.
            key: a saved key → the key it has here (the inter-stage slots: ints).
        """
        table, layouts = converted(state, what)
        table, layouts = {key(k): t for k, t in table.items()}, {key(k): v for k, v in layouts.items()}
        for name, tensor in table.items():
            shape = shapes.get(name) if shapes else None
            if shapes and shape is None:
                raise ValueError(f"{what} state has error feedback for {name!r}, which the model does not have")
            if shape is not None and tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{what} state error of {name!r} has shape {tuple(tensor.shape)}, the parameter needs {shape}"
                )
        rebuild = self._layout
        self.table = {name: tensor.clone() if rebuild else tensor for name, tensor in table.items()}
        self.layouts = {name: rebuild(plain) for name, plain in layouts.items()} if rebuild else {}
        self._flat.clear()


def converted(state: Any, what: str = "error feedback") -> tuple[dict, dict]:
    """(the table, the layouts' saved values) of a saved error feedback, in any format this library wrote:
    ``{"error": table[, "layouts": …]}`` (the one format; the sync methods' and the engine's before);
    ``{"residuals": table}`` (the inter-stage compressor's before); a table of (sizes, members, rank,
    bucket, values[, row multiple]) (the two-stage owners' before).

    Args:
        state: the saved error feedback.
        what: the owner's name, for the messages.

    Returns:
        (key → tensor, key → the values its layout is rebuilt from).
    """
    if not isinstance(state, dict):
        raise ValueError(f"corrupt {what} state: the error feedback must be a table")
    if state and all(isinstance(saved, (tuple, list)) and len(saved) >= 5 for saved in state.values()):
        table = {key: saved[4] for key, saved in state.items()}  # the two-stage owners': the values at 4
        layouts = {key: [*saved[:4], *saved[5:]] for key, saved in state.items()}
    elif "residuals" in state and "error" not in state:
        table, layouts = state["residuals"], {}
    else:
        table, layouts = state.get("error", {} if not state else None), state.get("layouts", {})
    if not isinstance(table, dict) or not all(isinstance(t, torch.Tensor) for t in table.values()):
        raise ValueError(f"corrupt {what} state: 'error' must be a table of tensors")
    return dict(table), dict(layouts)


class _Tied(MutableMapping):
    """`ErrorFeedback.by_layout`: key → (layout, tensor)."""

    def __init__(self, feedback: ErrorFeedback):
        self._feedback = feedback

    def __getitem__(self, key):
        return self._feedback.layouts[key], self._feedback.table[key]

    def __setitem__(self, key, value) -> None:
        self._feedback.layouts[key], self._feedback.table[key] = value

    def __delitem__(self, key) -> None:
        del self._feedback.layouts[key], self._feedback.table[key]

    def __iter__(self) -> Iterator:
        return iter(self._feedback.table)

    def __len__(self) -> int:
        return len(self._feedback.table)
