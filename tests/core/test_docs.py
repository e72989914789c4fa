"""The manual builds with warnings as errors (a broken reference, a missing page or a docstring that
does not parse fails here), its API reference documents every public name of `edgc` and
`edgc.integrations` and every class's constructor arguments, and its links to a heading work on
GitHub as on the site."""

import dataclasses
import importlib
import inspect
import re
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
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-b",
            "html",
            "-q",
            "-W",
            "--keep-going",
            "-j",
            "1",
            str(ROOT / "docs"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


def documented(site: Path) -> set[str]:
    from sphinx.util.inventory import InventoryFile

    with open(site / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    return {
        name
        for kind in ("py:class", "py:exception", "py:function", "py:method", "py:attribute")
        for name in inventory.get(kind, {})
    }


def public_names() -> set[str]:
    import edgc
    import edgc.integrations

    names = {f"edgc.{name}" for name in edgc.__all__}
    names |= {f"edgc.integrations.{name}" for name in edgc.integrations.__all__}
    subs = ("lightning", "torchft", "torchft_quorum", "diloco", "torchtitan", "torchtitan_torchft")
    for sub in subs:  # every public-looking name they define
        module = importlib.import_module(f"edgc.integrations.{sub}")
        names |= {
            f"{module.__name__}.{name}"
            for name, value in vars(module).items()
            if not name.startswith("_")
            and (inspect.isclass(value) or inspect.isfunction(value))
            and value.__module__ == module.__name__
        }
    return names


def documented_classes() -> dict[str, type]:
    """The public classes, and every class the API page documents."""
    names = public_names() | set(re.findall(r"autoclass:: ([\w.]+)", (ROOT / "docs" / "api.md").read_text()))
    found = {}
    for name in names:
        module, _, attribute = name.rpartition(".")
        value = getattr(importlib.import_module(module), attribute)
        if inspect.isclass(value):
            found[name] = value
    return found


def args_entry(parameter: str) -> re.Pattern:
    """An entry of a Google-style ``Args:`` section (as `sphinx.ext.napoleon` reads it) naming ``parameter``."""
    return re.compile(rf"^\s+\**{parameter}(?: \([^)]*\))?:", re.MULTILINE)


def test_every_documented_class_explains_each_argument_of_its_constructor():
    from edgc.config import field_docs

    unexplained = {}
    for name, cls in documented_classes().items():
        if dataclasses.is_dataclass(cls):  # a one-line docstring per field (what autodoc shows)
            missing = [field for field, _, doc in field_docs(cls) if not doc]
        else:
            text = (cls.__doc__ or "") + (cls.__init__.__doc__ or "" if "__init__" in vars(cls) else "")
            owner = next(c for c in cls.__mro__ if "__init__" in vars(c))
            parameters = [
                p.name
                for p in list(inspect.signature(owner.__init__).parameters.values())[1:]
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            if owner is not cls and re.search(rf"`[\w.]*\b{owner.__name__}`", text):  # inherited: explained there
                parameters = []
            missing = [p for p in parameters if f"``{p}``" not in text and not args_entry(p).search(text)]
            missing += [] if cls.__doc__ else ["(no class docstring)"]
        if missing:
            unexplained[name] = missing
    assert unexplained == {}, "name each argument as ``name`` in the class or __init__ docstring"


def test_the_site_builds_without_a_warning_and_documents_every_public_name(site):
    missing = sorted(public_names() - documented(site))
    assert missing == [], f"add them to docs/api.md: {missing}"


def test_the_configuration_page_lists_every_field_of_both_configs(site):
    import dataclasses

    from edgc import EDGCConfig
    from edgc_train.config import TrainConfig

    page = (site / "configuration.html").read_text()
    for field in dataclasses.fields(EDGCConfig):
        assert f'<code class="docutils literal notranslate"><span class="pre">{field.name}</span></code>' in page, (
            field.name
        )
    for field in dataclasses.fields(TrainConfig):
        assert f"--{field.name.replace('_', '-')}" in page, field.name


def test_the_api_reference_explains_edgc_states_arguments(site):
    page = (site / "api.html").read_text()
    section = page.split('id="edgc.EDGCState"', 1)[1].split('id="edgc.edgc_hook"', 1)[0]
    for argument in ("process_group", "config", "model", "follower", "always_profile", "decision_group"):
        literal = f'<code class="docutils literal notranslate"><span class="pre">{argument}</span></code>'
        assert literal in section or f"<strong>{argument}</strong>" in section, argument  # prose or Args:


def test_wide_tables_scroll_sideways_on_every_page(site):
    css = (ROOT / "docs" / "_static" / "edgc.css").read_text()
    assert re.search(r"\.table-wrapper\s*\{[^}]*overflow-x:\s*auto", css)
    for page in ("results/bench.html", "gpu.html", "index.html"):
        assert "_static/edgc.css" in (site / page).read_text(), page


def github_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page`` (its slug rule, as MyST implements it)."""
    from myst_parser.slugs import github_slugify

    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced = fenced != line.startswith("```")
        heading = re.match(r"#{1,6} (.+)", line)
        if heading and not fenced:
            text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "")
            slug = github_slugify(text)
            anchors.add(
                slug
                if slug not in anchors
                else next(f"{slug}-{i}" for i in range(1, 99) if f"{slug}-{i}" not in anchors)
            )
    return anchors


def test_every_link_to_a_heading_lands_on_it_on_github():
    """GitHub keeps a heading's underscores (``barrier_before_exit``); Sphinx's own ids make them
    hyphens, so a link written for the site alone lands at the top of the page on GitHub."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md|)#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            if linked.is_file() and anchor not in github_anchors(linked):
                broken.append(f"{page.relative_to(ROOT)} → {target}#{anchor}")
    assert broken == []
