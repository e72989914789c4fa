"""A step's values for the host, by name: added by each part, sent as one device tensor, read once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .timing import HostCopy


class StepTotals:
    """The values a step needs on the host, by name. Each part adds its own: the reducer the non-finite
    flag, ‖M−Ĝ‖² and ‖M‖² (``nonfinite``, ``error_sq``, ``norm_sq``), a method its extras (EDGC's
    warm-up probe, its entropy), as Python numbers, device tensors of one element (`add`), the
    elements of a 1-D one (`add_vector`) or a list of either, summed on the host (`add_sum`: one
    value per job, no device op per job). Adding touches no tensor: at the step's end `send` joins
    the device values, on the stream where they were computed, into one float64 device tensor (a
    ``cat`` per dtype and one cast each, `_joined_by_dtype`) that goes to the host behind an event
    (`edgc.device.timing.HostCopy`), and `read` reads it, once, when the step is settled. Python
    numbers never go to the device. Then they are read by name: ``totals[name]``, ``name in
    totals``, ``totals.get(name)`` (0.0 for a name not added: a step that saw no device sends
    nothing)."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._parts: list[list] = []  # per name: its values, Python numbers or device tensors, summed
        self._vectors: dict[int, int] = {}  # part index → elements, for `add_vector`'s parts
        self._weights: dict[int, list[float]] = {}  # part index → its values' weights, for `add_sum`'s
        self._copy: HostCopy | None = None
        self._order: list[int] | None = None  # where each sent element goes, when they were grouped by dtype
        self._host: dict[str, float] | None = None

    def add(self, **values: float | bool | torch.Tensor) -> None:
        """Named scalars for the host."""
        self._take(list(values), [[value] for value in values.values()])

    def add_sum(
        self, name: str, values: Sequence[float | bool | torch.Tensor], weights: Sequence[float] | None = None
    ) -> None:
        """One value for the host, the sum of ``values`` (device tensors of one element, or numbers), each
        times its weight in ``weights`` where given (on the host: no device op)."""
        self._take([name], [list(values)])
        if weights is not None:
            self._weights[len(self._parts) - 1] = list(weights)

    def add_vector(self, names: Sequence[str], vector: torch.Tensor) -> None:
        """The elements of a 1-D float64 device tensor for the host, one name each, in order."""
        if vector.dim() != 1 or vector.numel() != len(names):
            raise ValueError(f"StepTotals: {len(names)} names for a tensor of shape {tuple(vector.shape)}")
        self._take(list(names), [[vector]] + [[] for _ in names[1:]])
        self._vectors[len(self._parts) - len(names)] = len(names)

    def _take(self, names: list[str], parts: list[list]) -> None:
        if self._copy is not None or self._host is not None:
            raise RuntimeError(f"StepTotals: {names} added after the step's values were sent")
        twice = sorted(set(self._names) & set(names))
        if twice or len(set(names)) < len(names):
            raise ValueError(f"StepTotals: {twice or names} added twice")
        self._names += names
        self._parts += parts

    def _device_values(self) -> list[torch.Tensor]:
        return [value for part in self._parts for value in part if isinstance(value, torch.Tensor)]

    def device_of_values(self) -> torch.device | None:
        """The device of the values added so far (None: none is a tensor)."""
        tensors = self._device_values()
        return tensors[0].device if tensors else None

    def send(self, device: torch.device) -> None:
        """Join the device values into one float64 tensor on ``device``, made on the current stream (where
        the values were computed), and start its copy to the host."""
        tensors = [t.reshape(-1) for t in self._device_values()]
        if tensors:
            joined = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float64, device=device)
            self._order = _joined_by_dtype(tensors, joined)
            self._copy = HostCopy(joined)

    def read(self) -> None:
        """Read the sent values: the step's one host read, which waits for their copy alone. Once."""
        if self._host is not None:
            return
        values = self._copy.values() if self._copy is not None else []
        if self._order is not None:  # sent grouped by dtype: back to the order they were added in
            in_order = [0.0] * len(values)
            for value, place in zip(values, self._order):
                in_order[place] = value
            values = in_order
        sent = iter(values)
        host: dict[str, float] = {}
        index = 0
        while index < len(self._parts):
            if index in self._vectors:  # a vector's elements, one name each
                count = self._vectors[index]
                host.update((self._names[index + k], next(sent)) for k in range(count))
                index += count
                continue
            values = [next(sent) if isinstance(v, torch.Tensor) else float(v) for v in self._parts[index]]
            weights = self._weights.get(index, [1.0] * len(values))
            host[self._names[index]] = sum(v * w for v, w in zip(values, weights)) if values else 0.0
            index += 1
        self._host = host
        self._parts, self._copy, self._order = [], None, None

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


def _joined_by_dtype(tensors: list[torch.Tensor], joined: torch.Tensor) -> list[int] | None:
    """The values of ``tensors`` into the float64 ``joined``, grouped by dtype: a ``cat`` that casts copies
    input by input on a GPU (a kernel per job's flag or sum), so each dtype's values are joined in
    their own dtype (one batched copy) and cast into ``joined`` in one copy. Returns where each
    element of ``joined`` was in the plain ``cat`` of ``tensors`` (None: in order), for the host."""
    dtypes = list(dict.fromkeys(t.dtype for t in tensors))
    if dtypes == [joined.dtype] or len(tensors) == 1:
        torch.cat(tensors, out=joined)
        return None
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += t.numel()
    order, start = [], 0
    for dtype in dtypes:
        members = [k for k, t in enumerate(tensors) if t.dtype == dtype]
        same = [tensors[k] for k in members]
        size = sum(t.numel() for t in same)
        joined[start : start + size].copy_(same[0] if len(same) == 1 else torch.cat(same))
        order += [offsets[k] + i for k in members for i in range(tensors[k].numel())]
        start += size
    return order
