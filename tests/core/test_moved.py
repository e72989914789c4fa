"""The former flat layout's module paths still load (`edgc.moved`): what a checkpoint, a pickle or
user code names by an old path is the moved module itself."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
import warnings

import torch

import edgc
from edgc import EDGCConfig, EDGCState
from edgc.moved import MOVED


def test_every_old_path_is_the_moved_module_itself():
    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from edgc.lowrank import LowRankCompressor  # the form user code has

    assert LowRankCompressor is edgc.LowRankCompressor


def test_an_old_path_resolves_in_a_fresh_process_before_anything_else_is_imported():
    code = "from edgc.reducer import GradientReducer as old; "
    code += "import edgc.sync.reducer as r; print(old is r.GradientReducer)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


def old_paths(pickled: bytes) -> bytes:
    """A protocol-2 pickle as the flat layout wrote it: every moved module under its old name."""
    for old, new in sorted(MOVED.items(), key=lambda item: -len(item[1])):
        pickled = pickled.replace(f"c{new}\n".encode(), f"c{old}\n".encode())
    return pickled


def test_a_state_pickled_under_the_old_paths_loads_and_keeps_its_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = EDGCConfig(r_max=2, window=2, total_steps=8, warmup_fraction=0.0, warmup_error_test=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: averages over this process alone
        state = EDGCState(None, config, model=model)
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            state.synchronize(model.named_parameters())
    pickled = old_paths(pickle.dumps(state, protocol=2))
    assert b"cedgc.lowrank\n" in pickled and b"cedgc.engine.lowrank\n" not in pickled
    restored = pickle.loads(pickled)
    assert type(restored) is EDGCState and type(restored.compressor) is edgc.LowRankCompressor
    saved, loaded = state.state_dict(), restored.state_dict()
    assert saved.keys() == loaded.keys() and loaded["step"] == saved["step"] == 3
