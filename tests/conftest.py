import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

# The extras the suite tests (`make install` installs them all), each by a module it brings. A
# missing one stops the run before any test: its tests would otherwise fail to import one by one,
# or, worse, pass by skipping. The only skips are the machine's (`tests/core/test_skips.py`).
REQUIRED_EXTRAS = {
    "train": "transformers",
    "integrations": "pytorch_lightning",
    "torchft": "torchft",
    "torchtitan": "torchtitan",
    "docs": "sphinx",
    "dev": "hypothesis",
}


def missing_extras(find_spec=importlib.util.find_spec) -> list[str]:
    return [extra for extra, module in REQUIRED_EXTRAS.items() if find_spec(module) is None]


def pytest_configure(config):
    missing = missing_extras()
    if missing:
        extras = ",".join(missing)
        raise pytest.UsageError(f"the suite needs the extras {missing}: pip install -e '.[{extras}]' (make does)")


@pytest.fixture
def load_script():
    """Import ``scripts/<name>.py`` (the scripts are not a package) and return the module."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def load_producer(load_script):
    """The module that produces figure kind ``kind`` (what ``python scripts/to_docs.py KIND`` runs), found
    through the producers' registry."""
    return load_script("to_docs").producer


# Heaviest folders first. `make test` runs two pytest-xdist workers, each taking whole files in
# collection order (--dist loadfile): a long file started last would leave the other worker idle
# for its length. The order of the tests within a file is kept.
FOLDERS_BY_WEIGHT = ("train", "integrations", "experiments", "report", "bench", "core", "sim", "gpu")


def pytest_collection_modifyitems(config, items):
    def folder_rank(item) -> int:
        parts = Path(str(item.fspath)).parts
        folder = parts[parts.index("tests") + 1] if "tests" in parts else ""
        return FOLDERS_BY_WEIGHT.index(folder) if folder in FOLDERS_BY_WEIGHT else len(FOLDERS_BY_WEIGHT)

    items.sort(key=folder_rank)


# Files whose tests share a session fixture's training run: one xdist scope each, so that one
# worker runs the shared run once (under plain --dist loadfile each worker would run it again).
SHARED_RUN_SCOPES = {
    "tests/train/test_fault_tolerance.py": "tests/train/test_torchrun.py",  # reference_run
    "tests/train/test_tensor_parallel.py": "tests/train/test_pipeline.py",  # shared_runs
    "tests/train/test_fsdp_train.py": "tests/train/test_pipeline.py",  # shared_runs
    "tests/train/test_moe_train.py": "tests/train/test_pipeline.py",  # shared_runs
}

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # without pytest-xdist the suite runs in one process
    LoadFileScheduling = None

if LoadFileScheduling is not None:

    class SharedRunScheduling(LoadFileScheduling):
        """--dist loadfile, with the files of `SHARED_RUN_SCOPES` joined."""

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_RUN_SCOPES.get(scope, scope)

    def pytest_xdist_make_scheduler(config, log):
        return SharedRunScheduling(config, log) if config.getoption("dist") == "loadfile" else None
