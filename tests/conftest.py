import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture
def load_script():
    """Import ``scripts/<name>.py`` (the scripts are not a package) and return the module."""
    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load
