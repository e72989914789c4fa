"""A checkpoint names no module of the library: every stateful piece's ``state_dict()`` is tensors and
plain values, so ``torch.load(weights_only=True)`` reads it, and a checkpoint written before a module
moved loads after it (the modules beneath `edgc` are internal and may move: CHANGELOG.md)."""

from __future__ import annotations

import dataclasses
import io
import pickle
import pickletools
import warnings

import pytest
import torch
from torch import nn

from edgc import EDGCConfig, EDGCState, LowRankConfig
from edgc.integrations.diloco import DiLoCo
from edgc.sync.sync_methods import sync_method, sync_method_names


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))


def trained(state, net: nn.Module, steps: int = 3):
    for _ in range(steps):
        net(torch.randn(4, 64)).sum().backward()
        state.synchronize(net.named_parameters())
        net.zero_grad()
    return state


def assert_plain(saved: dict) -> None:
    """Pickled, it names no edgc module, and it loads under ``weights_only`` to equal values."""
    globals_named = [arg for op, arg, _ in pickletools.genops(pickle.dumps(saved, protocol=2)) if op.name == "GLOBAL"]
    assert not [name for name in globals_named if name.split()[0].split(".")[0] == "edgc"], globals_named
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert equal(loaded, saved)


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    return type(a) is type(b) and (a == b or a != a and b != b)  # NaN equals NaN here


def test_a_pickled_library_object_is_caught():
    with pytest.raises(AssertionError):
        assert_plain({"config": EDGCConfig()})


@pytest.fixture(autouse=True)
def no_process_group_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: each averages over this process alone
        yield


def test_edgc_state_after_compressed_steps():
    net = model()
    config = EDGCConfig(r_max=2, window=2, total_steps=8, warmup_fraction=0.0, warmup_error_test=False)
    state = trained(EDGCState(None, config, model=net), net)
    saved = state.state_dict()
    assert saved["step"] == 3
    assert_plain(saved)


@pytest.mark.parametrize("name", sync_method_names())
def test_every_registered_sync_method(name):
    net = model()
    assert_plain(trained(sync_method(name).build(None, model=net), net).state_dict())


def test_diloco_after_outer_steps():
    net = model()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with DiLoCo(None, [net], inner, outer, sync_every=2) as diloco:
        for _ in range(6):
            net(torch.randn(4, 64)).sum().backward()
            inner.step()
            inner.zero_grad()
    assert_plain(diloco.state_dict())


def test_a_checkpoint_whose_config_has_the_engine_fields_flat_loads_as_saved():
    config = EDGCConfig(r_max=2, window=2, total_steps=8, warmup_fraction=0.0, warmup_error_test=False)
    net = model()
    saved = trained(EDGCState(None, config, model=net), net).state_dict()
    nested = saved["config"]
    flat = {**{k: v for k, v in nested.items() if k != "engine"}, **nested["engine"]}  # what earlier versions saved
    fresh = EDGCState(None, config, model=model())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fresh.load_state_dict({**saved, "config": flat})
    assert not [str(w.message) for w in said if "different config" in str(w.message)]
    assert equal(fresh.state_dict(), saved)
    other = EDGCState(None, dataclasses.replace(config, engine=LowRankConfig(seed=1)), model=model())
    with pytest.warns(UserWarning, match=r"different config fields \['engine.seed'\]"):
        other.load_state_dict({**saved, "config": flat})
