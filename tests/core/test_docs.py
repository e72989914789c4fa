"""The manual builds with warnings as errors (a broken reference, a missing page or a docstring that
does not parse fails here), and its API reference documents every public name of `edgc` and
`edgc.integrations`."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    import importlib.util

    assert importlib.util.find_spec("sphinx"), "the docs extra is not installed: pip install -e '.[docs]' (make does)"
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going", "-j", "1",
                           str(ROOT / "docs"), str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


def documented(site: Path) -> set[str]:
    from sphinx.util.inventory import InventoryFile

    with open(site / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    return {name for kind in ("py:class", "py:function", "py:method", "py:attribute") for name in inventory.get(kind, {})}


def public_names() -> set[str]:
    import edgc
    import edgc.integrations

    names = {f"edgc.{name}" for name in edgc.__all__}
    names |= {f"edgc.integrations.{name}" for name in edgc.integrations.__all__}
    for sub in ("lightning", "torchft"):
        module = importlib.import_module(f"edgc.integrations.{sub}")
        names |= {f"edgc.integrations.{sub}.{name}" for name in getattr(module, "__all__", [])}
    return names


def test_the_site_builds_without_a_warning_and_documents_every_public_name(site):
    missing = sorted(public_names() - documented(site))
    assert missing == [], f"add them to docs/api.md: {missing}"


def test_the_configuration_page_lists_every_field_of_both_configs(site):
    import dataclasses

    from edgc import EDGCConfig
    from edgc_train.config import TrainConfig

    page = (site / "configuration.html").read_text()
    for field in dataclasses.fields(EDGCConfig):
        assert f"<code class=\"docutils literal notranslate\"><span class=\"pre\">{field.name}</span></code>" in page, field.name
    for field in dataclasses.fields(TrainConfig):
        assert f"--{field.name.replace('_', '-')}" in page, field.name
