"""Every thread and every future under the stream checker (`edgc_probes.stream_check`).

A dispatch mode is thread-local, so a checker entered on one thread sees nothing of another. On
CUDA much of a step runs elsewhere: DDP's comm hook on autograd's device thread, torchft's quorum
and heal on an executor's thread, a future's callback on whichever thread completes it. While a
checker is active, every thread started, every executor task submitted and every callback given
to a future (``then``, ``add_done_callback``) from a thread it watches runs under it too, on its
own current stream (the compute stream, as a new CUDA thread's), with the checker's state guarded
by its lock. Threads it does not watch (a peer replica's in the same process, a library's own
that were running before) go on unchanged.

Futures are ordered as CUDA's are: a work's future (``Work.get_future``) completes where the work
does; a callback (``then``) runs on streams that wait for its future first, and the future ``then``
returns completes where the callback left its stream; ``wait`` makes the current stream wait for
that (torchft's managed works are chains of such futures).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _pop_mode, _push_mode


class Threads:
    """Which threads run under ``checker``, and the wrappers that carry it into new ones."""

    def __init__(self, checker):
        self.checker = checker
        self._local = threading.local()  # .inside: this thread runs under the checker

    def inside(self) -> bool:
        return getattr(self._local, "inside", False)

    def entered(self) -> None:
        self._local.inside = True

    def left(self) -> None:
        self._local.inside = False

    def carried(self, fn):
        """``fn`` run under the checker (on the thread that calls it), if the caller of this is watched."""
        if not self.checker.watching():
            return fn

        @functools.wraps(fn)
        def under_checker(*args, **kwargs):
            if self.inside() or not self.checker.active:
                return fn(*args, **kwargs)  # already under it (nested), or it has exited since
            self._local.inside = True
            _push_mode(self.checker)
            try:
                return fn(*args, **kwargs)
            finally:
                _pop_mode()
                self._local.inside = False

        return under_checker

    def install(self, set_) -> None:
        set_(threading.Thread, "start", self._thread_start)
        set_(concurrent.futures.ThreadPoolExecutor, "submit", self._submit)
        set_(dist.Work, "get_future", self._work_future)
        for future in (torch.futures.Future, torch._C.Future):
            set_(future, "then", self._then)
            set_(future, "add_done_callback", self._callback_taker)
            set_(future, "wait", self._future_wait)

    def _thread_start(self, original):
        threads = self

        def start(thread, *args, **kwargs):
            if threads.checker.watching():
                thread.run = threads.carried(thread.run)
            return original(thread, *args, **kwargs)

        return start

    def _submit(self, original):
        threads = self

        def submit(executor, fn, /, *args, **kwargs):
            return original(executor, threads.carried(fn), *args, **kwargs)

        return submit

    def _callback_taker(self, original):
        threads = self

        def take(future, callback):
            return original(future, threads.carried(callback))

        return take

    # ------------------------------------------------------------------ futures
    def _ends(self, future) -> dict | None:
        """Where ``future`` completes ({"state": …} once known), if the checker knows it."""
        known = self.checker.futures.get(id(future))
        return known[1] if known is not None and known[0] is future else None

    def _work_future(self, original):
        threads = self

        def get_future(work):
            future = original(work)
            known = threads.checker.works.get(id(work))
            if known is not None and known[0] is work:
                threads.checker.futures[id(future)] = (future, {"state": known[1]})
            return future

        return get_future

    def _then(self, original):
        threads = self
        checker = self.checker

        def then(future, callback):
            parent, ends = threads._ends(future), {}

            def ordered(*args, **kwargs):
                if checker.watching():
                    if parent is not None and "state" in parent:
                        checker.wait(checker.current(), parent["state"])
                    result = callback(*args, **kwargs)
                    ends["state"] = checker.state_of(checker.current())
                    return result
                return callback(*args, **kwargs)

            child = original(future, threads.carried(ordered))
            if checker.watching():
                checker.futures[id(child)] = (child, ends)
            return child

        return then

    def _future_wait(self, original):
        threads = self

        def wait(future):
            result = original(future)
            ends = threads._ends(future)
            if ends is not None and "state" in ends and threads.checker.watching():
                threads.checker.wait(threads.checker.current(), ends["state"])
            return result

        return wait
