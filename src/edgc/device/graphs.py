"""Graph regions: a named stretch of device work over fixed buffers, run eagerly or replayed from a CUDA graph.

    send_p = GraphRegion("send_p", graphs=True)          # kept from step to step, one per layout
    ...
    send_p(lambda: form_p(q_in, arena, p_flat), q_in, arena, p_flat)   # every step
    comm.mean_async(p_flat)                               # collectives stay outside

What a region's code holds to (its contract; `edgc_probes.capture_check` proves it on the CPU):
- ``fn`` takes no argument and returns nothing; its one effect is device work that reads and writes
  the ``buffers`` passed with the call (a tensor stands for its whole storage: a view of a passed
  buffer is passed). What else it allocates is scratch, dead when it returns. A tensor made outside
  the call and read or written inside it, or made inside and used after it, crosses the region's
  boundary: it must be one of the buffers, the same storage at every call.
- Every call does the same work: the same operators with the same non-tensor arguments on tensors of
  the same shapes, dtypes and strides.
- No host synchronisation (``.item()``, ``tolist``, a blocking copy, an event's or a stream's
  ``synchronize``), no size that depends on values (``nonzero``, a boolean mask), no collective and no
  wait for another stream or a collective: those go before or after the call.
- Python side effects of ``fn`` happen at eager calls and at a capture only: a replay runs none of
  ``fn``'s Python, only the device work it captured.

How a call runs. Off CUDA (the CPU, where graphs cannot be captured), or with ``graphs=False``, or while
the current stream is already being captured (a caller's graph holds this work): ``fn()`` eagerly.
On CUDA with ``graphs=True``: the first ``warmup_calls`` calls run eagerly (lazy initialisation, such
as cuBLAS's and cuSOLVER's handles and workspaces, stays out of the graph), the next one is captured
into a `torch.cuda.CUDAGraph` (its own memory pool, or ``pool``) and replayed at once (a capture runs
nothing), and every later call is one replay on the current stream. A capture synchronises the device
(`torch.cuda.graph` does), as an allowed host read (`edgc.device.timing.host_reads_allowed`): it
happens once per layout, not per step.

Captured again. `recapture` (a rank change, a new layout) drops the graph: the next calls warm up and
capture again. A call whose buffers are not those captured (another storage, shape, stride or dtype)
does the same by itself, since replaying would read the old ones. Each capture is one line on the
``edgc`` logger (INFO) with its reason; a capture that fails is one WARNING line, and the region runs
eagerly from then on.

Observers. `observing(observer)` tells ``observer`` of every call in its body, from any thread:
``region_begin(region, buffers, mode)`` before and ``region_end(region, buffers, mode)`` after, mode
`EAGER`, `CAPTURE` or `REPLAY`. That is how a checker (`edgc_probes.capture_check`) and the dispatch
counter (`edgc_probes.dispatch_count`) see where a region begins and ends and what crosses it. A region
holds no state worth a checkpoint: a resumed run captures anew.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from . import timing

LOGGER = logging.getLogger("edgc")
EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


class RegionObserver(Protocol):
    """What `observing` calls at each region call (see the module docstring)."""

    def region_begin(self, region: GraphRegion, buffers: tuple[torch.Tensor, ...], mode: str) -> None: ...

    def region_end(self, region: GraphRegion, buffers: tuple[torch.Tensor, ...], mode: str) -> None: ...


_observers: list[RegionObserver] = []


@contextlib.contextmanager
def observing(observer: RegionObserver) -> Iterator[RegionObserver]:
    """Tell ``observer`` of every region call (every thread) while the body runs."""
    _observers.append(observer)
    try:
        yield observer
    finally:
        _observers.remove(observer)


def _on_cuda(buffers: tuple[torch.Tensor, ...]) -> bool:
    return any(t.is_cuda for t in buffers)


def _signature(buffers: tuple[torch.Tensor, ...]) -> tuple:
    """What a replay relies on: each buffer's memory, shape, strides and dtype."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in buffers)


class GraphRegion:
    """A named stretch of device work over fixed buffers; see the module docstring.

    ``name``: what the logger, the checker and the counter call it. ``graphs``: capture and replay on
    CUDA (False: always eager). ``warmup_calls``: eager calls before each capture (≥ 1). ``pool``: a
    graph memory pool to share (`torch.cuda.graph_pool_handle`; None: the graph's own), only safe for
    regions replayed in the order they were captured. ``capture_error_mode``: `torch.cuda.graph`'s;
    ``thread_local`` by default, since a hook captures on autograd's thread while others may allocate.
    ``rank``: this process's rank in the group whose rank 0 speaks for it on the ``edgc`` logger
    (`edgc.runner.events.GROUP_RANK_ZERO`: every rank captures alike, one says so).
    """

    def __init__(
        self,
        name: str,
        *,
        graphs: bool = False,
        warmup_calls: int = 2,
        pool=None,
        capture_error_mode: str = "thread_local",
        rank: int = 0,
    ):
        if not isinstance(name, str) or not name:
            raise ValueError(f"GraphRegion: name must be a non-empty string, got {name!r}")
        if not isinstance(warmup_calls, int) or warmup_calls < 1:
            raise ValueError(f"GraphRegion {name!r}: warmup_calls must be an int ≥ 1, got {warmup_calls!r}")
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(
                f"GraphRegion {name!r}: capture_error_mode must be one of {CAPTURE_ERROR_MODES}, "
                f"got {capture_error_mode!r}"
            )
        self.name = name
        self.graphs = bool(graphs)
        self.warmup_calls = warmup_calls
        self.pool = pool
        self.capture_error_mode = capture_error_mode
        self.rank = rank
        self.calls = 0  # every call, eager or not
        self.captures = 0  # graphs captured so far
        self._graph: torch.cuda.CUDAGraph | None = None
        self._captured_with: tuple | None = None  # `_signature` of the captured buffers
        self._eager_calls = 0  # eager calls since the last capture was dropped (or ever)
        self._reason = "first capture"  # why the next capture happens

    def __repr__(self) -> str:
        state = "captured" if self._graph is not None else "eager"
        return f"GraphRegion({self.name!r}, graphs={self.graphs}, {state}, calls={self.calls})"

    @property
    def captured(self) -> bool:
        """Whether a graph is held: the next call with the same buffers is a replay."""
        return self._graph is not None

    def recapture(self, reason: str) -> None:
        """Drop the graph (if any): the next calls warm up and capture again; ``reason`` (a rank change,
        a new layout) is said with that capture."""
        self._graph = self._captured_with = None
        self._eager_calls = 0
        self._reason = reason

    def __call__(self, fn: Callable[[], None], *buffers: torch.Tensor) -> None:
        """Run ``fn`` (eagerly, captured, or as a replay of its capture) over ``buffers``."""
        mode = self._mode(buffers)
        observers = list(_observers)
        for observer in observers:
            observer.region_begin(self, buffers, mode)
        try:
            if mode == EAGER:
                fn()
            elif mode == CAPTURE:
                self._capture(fn, buffers)
            else:
                self._graph.replay()
        finally:
            self.calls += 1
            for observer in observers:
                observer.region_end(self, buffers, mode)

    def _mode(self, buffers: tuple[torch.Tensor, ...]) -> str:
        if not self.graphs or not _on_cuda(buffers) or torch.cuda.is_current_stream_capturing():
            return EAGER
        if self._graph is not None:
            if _signature(buffers) == self._captured_with:
                return REPLAY
            self.recapture("its buffers are not those captured (another storage, shape, stride or dtype)")
        if self._eager_calls < self.warmup_calls:
            self._eager_calls += 1
            return EAGER
        return CAPTURE

    def _capture(self, fn: Callable[[], None], buffers: tuple[torch.Tensor, ...]) -> None:
        """Capture ``fn`` and replay it once (a capture runs nothing); a failed capture runs ``fn`` eagerly,
        and so does every later call."""
        graph = torch.cuda.CUDAGraph()
        try:
            with (
                timing.host_reads_allowed(),
                torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.capture_error_mode),
            ):
                fn()
        except RuntimeError as error:
            self.graphs = False
            LOGGER.warning(
                "graph region %s: capture failed, runs eagerly from now on: %s",
                self.name,
                str(error).splitlines()[0] if str(error) else type(error).__name__,
                extra={
                    "edgc": {"kind": "graph_failed", "region": self.name, "message": str(error)},
                    "edgc_rank": self.rank,
                },
            )
            fn()
            return
        self._graph, self._captured_with = graph, _signature(buffers)
        self.captures += 1
        message = f"graph region {self.name}: captured (capture {self.captures}, {self._reason})"
        record = {"kind": "graph_captured", "region": self.name, "message": message}
        LOGGER.info(message, extra={"edgc": record, "edgc_rank": self.rank})
        self._reason = "captured again"
        graph.replay()
