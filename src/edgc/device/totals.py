"""A step's values for the host, by name: added by each part, sent as one device tensor, read once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .timing import HostCopy, device_scalar


class StepTotals:
    """The values a step needs on the host, by name. Each part adds its own: the reducer the non-finite
    flag, ‖M−Ĝ‖² and ‖M‖² (``nonfinite``, ``error_sq``, ``norm_sq``), a method its extras (EDGC's
    warm-up probe), as Python numbers, 0-dim device tensors (`add`) or the elements of a 1-D float64
    one (`add_vector`). Adding touches no tensor: at the step's end `send` stacks them, on the stream
    where they were computed, into one float64 device tensor that goes to the host behind an event
    (`edgc.device.timing.HostCopy`), and `read` reads it, once, when the step is settled. Then they are read
    by name: ``totals[name]``, ``name in totals``, ``totals.get(name)`` (0.0 for a name not added: a
    step that saw no device sends nothing)."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._parts: list[tuple[bool, float | bool | torch.Tensor]] = []  # (a vector, its value), in name order
        self._copy: HostCopy | None = None
        self._host: dict[str, float] | None = None

    def add(self, **values: float | bool | torch.Tensor) -> None:
        """Named scalars for the host."""
        self._take(list(values), [(False, value) for value in values.values()])

    def add_vector(self, names: Sequence[str], vector: torch.Tensor) -> None:
        """The elements of a 1-D float64 device tensor for the host, one name each, in order."""
        if vector.dim() != 1 or vector.numel() != len(names):
            raise ValueError(f"StepTotals: {len(names)} names for a tensor of shape {tuple(vector.shape)}")
        self._take(list(names), [(True, vector)])

    def _take(self, names: list[str], parts: list[tuple[bool, float | bool | torch.Tensor]]) -> None:
        if self._copy is not None or self._host is not None:
            raise RuntimeError(f"StepTotals: {names} added after the step's values were sent")
        twice = sorted(set(self._names) & set(names))
        if twice or len(set(names)) < len(names):
            raise ValueError(f"StepTotals: {twice or names} added twice")
        self._names += names
        self._parts += parts

    def send(self, device: torch.device) -> None:
        """Stack what was added into one float64 tensor on ``device``, made on the current stream (where
        the values were computed), and start its copy to the host."""
        values: list[torch.Tensor] = []
        for vector, value in self._parts:
            values += value.unbind() if vector else [device_scalar(value, device)]  # type: ignore[union-attr]
        if values:
            self._copy = HostCopy(torch.stack(values))

    def read(self) -> None:
        """Read the sent values: the step's one host read, which waits for their copy alone. Once."""
        if self._host is None:
            values = self._copy.values() if self._copy is not None else []
            self._host = dict(zip(self._names, values))
            self._parts, self._copy = [], None

    def _values(self) -> dict[str, float]:
        if self._host is None:
            raise RuntimeError("StepTotals: read only once the step is settled (`read`)")
        return self._host

    def __getitem__(self, name: str) -> float:
        return self._values()[name]

    def __contains__(self, name: str) -> bool:
        return name in self._values()

    def get(self, name: str, default: float = 0.0) -> float:
        return self._values().get(name, default)
