"""DiLoCo's outer syncs under the CPU stream checker (`edgc_probes.stream_check`), two gloo processes.

Every registered sync method (`edgc.sync.sync_methods`, read when the test runs: a method added later is
checked too) and EDGC's PowerSGD: inner steps, outer steps, a checkpoint, and a resume in a new
run whose first outer sync moves the loaded error feedback to the device and replaces it on the
jobs' stream. EDGC's runs as Streaming DiLoCo (two fragments, each sync started two inner steps
before its outer step, overlapping them). All of it built under the checker, on the accelerator's
kernels; no race, no stale host read, no host synchronisation from the library in any step.
"""

import io
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # distributed_harness, models

from distributed_harness import run_distributed  # noqa: E402
from models import TinyTransformer, batch, loss_fn  # noqa: E402

from edgc import EDGCConfig  # noqa: E402
from edgc.integrations.diloco import DiLoCo  # noqa: E402
from edgc.sync.sync_methods import sync_method_names  # noqa: E402
from edgc_probes.stream_check import StreamChecker  # noqa: E402

from .test_diloco import CONFIG  # noqa: E402

VOCAB, SYNC_EVERY = 32, 4


def built(checker, method: str | None, outer_steps: int):
    """A tiny model and its DiLoCo, on the device (built under the checker)."""
    with checker.device():
        torch.manual_seed(0)
        model = TinyTransformer(vocab=VOCAB, width=16, layers=1, heads=2, seq_len=8)
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5, nesterov=True)
        if method is None:  # EDGC's PowerSGD, streaming: two fragments, each sync overlapping 2 inner steps
            ends = nn.ModuleDict({"embed": model.embed, "head": model.head})
            ends.register_parameter("position", model.position)
            config = EDGCConfig(total_steps=2 * outer_steps, **CONFIG)
            config = replace(config, engine=replace(config.engine, force_accelerator_kernels=True))
            diloco = DiLoCo(None, [ends, model.blocks], inner, outer, 2 * SYNC_EVERY, config, fragment_sync_delay=2)
            diloco.issued = []  # (inner step, thread) of every collective of the sync
            issue = diloco.state.comm._issue

            def issued(*args, **kwargs):
                diloco.issued.append((diloco._local_step, threading.get_ident()))
                return issue(*args, **kwargs)

            diloco.state.comm._issue = issued
        else:
            diloco = DiLoCo(None, [model], inner, outer, SYNC_EVERY, sync_method=method)
    return model, inner, diloco


def inner_steps(rank, model, inner, diloco, start: int, stop: int) -> None:
    with diloco:
        for step in range(start, stop):
            loss_fn(model, *batch(rank, step, vocab=VOCAB, seq_len=8)).backward()
            inner.step()
            inner.zero_grad()


def resume_worker(rank, world_size, methods):
    """Per method: two outer steps, a checkpoint, a resumed run of two more."""
    found = {}
    for method in methods:
        split, stop = 2 * SYNC_EVERY, 4 * SYNC_EVERY
        with StreamChecker() as checker:
            model, inner, diloco = built(checker, method, 4)
            inner_steps(rank, model, inner, diloco, 0, split)
            saved = io.BytesIO()
            torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()}, saved)
            model, inner, diloco = built(checker, method, 4)
            loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
            model.load_state_dict(loaded["model"])
            inner.load_state_dict(loaded["inner"])
            diloco.load_state_dict(loaded.pop("diloco"))
            del loaded  # the checkpoint's tensors live on in the states alone, as in a real resume
            inner_steps(rank, model, inner, diloco, split, stop)
            outer = diloco.last_outer_step
        issued = getattr(diloco, "issued", [])
        found[method or "edgc"] = {
            "issue_steps": sorted({step for step, _ in issued}),
            "other_threads": sum(thread != threading.get_ident() for _, thread in issued),
            "races": checker.races[:3],
            "host_syncs": [str(s) for s in checker.host_syncs][:3],
            "phase": outer["phase"],
            "method": outer["method"],
        }
    return found


@pytest.mark.parametrize("half", [0, 1])
def test_every_outer_sync_resumed_is_ordered_and_never_waits_for_the_device(half):
    """The loaded error feedback of every method reaches the device without a host wait and stays
    alive until the jobs' stream is done with it (`edgc.device.timing.state_to_device`)."""
    methods = [None, *sync_method_names()]
    methods = methods[half::2]  # two calls, so that a failure names fewer methods
    for found in run_distributed(resume_worker, 2, methods, timeout=600):
        for method, result in found.items():
            assert result["method"] == method and result["phase"] == "compress", (method, result)
            assert result["races"] == [] and result["host_syncs"] == [], (method, result)
        if "edgc" in found:  # EDGC's streaming sync: every collective from the training thread (a worker
            # thread drove a second communicator's order against the inner steps'), spread over the inner
            # steps between a sync's start and its outer step
            assert found["edgc"]["other_threads"] == 0, found["edgc"]
            assert found["edgc"]["issue_steps"] == [2, 3], found["edgc"]
