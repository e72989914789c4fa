"""Where each module of the library's former flat layout went: old import paths keep working.

A checkpoint or a pickled state names its classes by module (``edgc.lowrank.LowRankCompressor``),
and user code imports them so; `install` puts a finder at the end of ``sys.meta_path`` that answers
each old name with the module that now holds it (the same module object, so a patch through either
name is seen through both). Nothing else imports through it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

MOVED = {
    "edgc.torch_adapter": "edgc.adapters.torch_adapter",
    "edgc.fsdp_adapter": "edgc.adapters.fsdp_adapter",
    "edgc.streams": "edgc.device.streams",
    "edgc.timing": "edgc.device.timing",
    "edgc.totals": "edgc.device.totals",
    "edgc.finite": "edgc.device.finite",
    "edgc.mesh": "edgc.distributed.mesh",
    "edgc.comm": "edgc.distributed.comm",
    "edgc.detached": "edgc.distributed.detached",
    "edgc.experts": "edgc.distributed.experts",
    "edgc.agreement": "edgc.distributed.agreement",
    "edgc.plans": "edgc.policies.plans",
    "edgc.rank_model": "edgc.policies.rank_model",
    "edgc.rank_rules": "edgc.policies.rank_rules",
    "edgc.rank_split": "edgc.policies.rank_split",
    "edgc.signals": "edgc.policies.signals",
    "edgc.factors": "edgc.engine.factors",
    "edgc.layout": "edgc.engine.layout",
    "edgc.engine_state": "edgc.engine.engine_state",
    "edgc.rank_change": "edgc.engine.rank_change",
    "edgc.orthonormal_choice": "edgc.engine.orthonormal_choice",
    "edgc.lowrank": "edgc.engine.lowrank",
    "edgc.jobs": "edgc.engine.jobs",
    "edgc.entropy": "edgc.control.entropy",
    "edgc.budget": "edgc.control.budget",
    "edgc.profiling": "edgc.control.profiling",
    "edgc.alignment": "edgc.control.alignment",
    "edgc.rank_control": "edgc.control.rank_control",
    "edgc.decisions": "edgc.control.decisions",
    "edgc.shadow": "edgc.control.shadow",
    "edgc.events": "edgc.control.events",
    "edgc.guards": "edgc.safeguards.guards",
    "edgc.fingerprint": "edgc.safeguards.fingerprint",
    "edgc.checkpoint": "edgc.safeguards.checkpoint",
    "edgc.steps": "edgc.sync.steps",
    "edgc.gradients": "edgc.sync.gradients",
    "edgc.reducer": "edgc.sync.reducer",
    "edgc.error_feedback": "edgc.sync.error_feedback",
    "edgc.baselines": "edgc.sync.baselines",
    "edgc.outer_sync": "edgc.sync.outer_sync",
    "edgc.outer_alloc": "edgc.sync.outer_alloc",
    "edgc.outer_sparse": "edgc.sync.outer_sparse",
    "edgc.codecs": "edgc.sync.codecs",
    "edgc.two_stage": "edgc.sync.two_stage",
    "edgc.sync_methods": "edgc.sync.sync_methods",
    "edgc.fsdp": "edgc.parallel.fsdp",
    "edgc.interstage": "edgc.parallel.interstage",
    "edgc.pipeline": "edgc.parallel.pipeline",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module name with the module that now holds it."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        return types.ModuleType(spec.name)  # a stand-in: exec_module puts the real one in its place

    def exec_module(self, module):
        # The import system returns what sys.modules holds under the name after this call, so the
        # moved module itself is returned, its own __spec__ untouched.
        sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


def install() -> None:
    """Add the finder once (after every other, so a module that exists is always found first)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
