"""The library's shape by composition, held so that it cannot drift back: a state that owns a few
collaborators, no class on two library bases, short functions, one definition per setting. Read
from the source with `ast` where it can be, and from one small state that has stepped."""

from __future__ import annotations

import ast
import dataclasses
import warnings
from pathlib import Path

import torch

from edgc import EDGCConfig, EDGCState, LowRankCompressor, LowRankConfig
from edgc.engine_state import EngineState

LIBRARY = Path(__file__).resolve().parents[2] / "src" / "edgc"
MAX_STATE_ATTRIBUTES = 15
MAX_FUNCTION_LINES = 80


def library_trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(LIBRARY.rglob("*.py"))}


def base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def test_a_state_that_has_stepped_holds_at_most_15_attributes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    config = EDGCConfig(
        r_max=4,
        window=2,
        total_steps=8,
        warmup_fraction=0.0,
        min_warmup_steps=1,
        warmup_error_test=False,
        iteration_sample_ratio=1.0,
    )
    state = EDGCState(None, config, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: it averages over this process alone
        for _ in range(6):  # warm-up, then compressed steps with window decisions
            model.zero_grad()
            model(torch.randn(8, 16)).square().sum().backward()
            state.synchronize(model.named_parameters())
    assert state.last_step_metrics["phase"] == "compress" and state.last_decision is not None
    attributes = sorted(vars(state))
    assert len(attributes) <= MAX_STATE_ATTRIBUTES, attributes


def test_no_library_class_has_two_library_bases():
    trees = library_trees()
    library_classes = {
        node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
    }
    offenders = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [name for name in map(base_name, node.bases) if name in library_classes]
                if len(bases) > 1:
                    offenders.append(f"{path.name}: class {node.name}({', '.join(bases)})")
            # type(name, (A, B), {}): a class made at run time counts too
            elif (
                isinstance(node, ast.Call)
                and base_name(node.func) == "type"
                and len(node.args) == 3
                and isinstance(node.args[1], ast.Tuple)
                and len(node.args[1].elts) > 1
            ):
                offenders.append(f"{path.name}:{node.lineno}: type(…) with {len(node.args[1].elts)} bases")
    assert offenders == [], "compose instead: a collaborator the class owns, or the communicator it is given"
    assert not issubclass(LowRankCompressor, EngineState)  # the compressor holds its state
    assert isinstance(LowRankCompressor(LowRankConfig()).state, EngineState)


def test_no_library_function_is_longer_than_80_lines():
    long = []
    for path, tree in library_trees().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(LIBRARY)}: {node.name} ({lines} lines)")
    assert long == [], "split it: one helper per stretch of what it does"


# The rules over every package and the scripts, not the library alone.
ROOT = LIBRARY.parents[1]
PACKAGES = sorted(p.parent for p in (ROOT / "src").glob("*/__init__.py"))
MAX_CLASS_ATTRIBUTES = 15
MAX_FILE_LINES = 400
# src/edgc's long files are split by its move into subpackages, its wide classes (EntropySampler,
# WindowController) by their parts; until then the library is exempt from these two rules, and this
# exemption goes once it meets them.
LIBRARY_SPLIT_ELSEWHERE = LIBRARY


def all_trees() -> dict[str, ast.Module]:
    """Every package's modules and the scripts, by path from the repository root."""
    paths = [p for package in PACKAGES for p in package.rglob("*.py")] + sorted((ROOT / "scripts").glob("*.py"))
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in paths}


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1


def self_attributes(cls: ast.ClassDef) -> set[str]:
    """What a class's methods assign on ``self``: the state its objects hold. A dataclass's fields are
    a value's (settings, a record) and do not count."""
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def test_no_function_in_any_package_or_script_is_longer_than_80_lines():
    long = {
        f"{path}:{node.name}"
        for path, tree in all_trees().items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and function_lines(node) > MAX_FUNCTION_LINES
    }
    assert long == set(), "split it: one helper per stretch of what it does"


def test_no_class_outside_the_library_assigns_more_than_15_attributes():
    wide = {
        f"{path}:{node.name}"
        for path, tree in all_trees().items()
        if not (ROOT / path).is_relative_to(LIBRARY_SPLIT_ELSEWHERE)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and len(self_attributes(node)) > MAX_CLASS_ATTRIBUTES
    }
    assert wide == set(), "give it parts: objects it owns, each holding what belongs together"


def test_no_file_outside_the_library_is_longer_than_400_lines():
    long = {
        path
        for path in all_trees()
        if not (ROOT / path).is_relative_to(LIBRARY_SPLIT_ELSEWHERE)
        and len((ROOT / path).read_text().splitlines()) > MAX_FILE_LINES
    }
    assert long == set(), "split it by meaning into modules of the same package"


def test_each_setting_is_defined_once_and_flat_keywords_reach_the_nested_engine():
    configs = [EDGCConfig, LowRankConfig]
    fields = [f.name for config in configs for f in dataclasses.fields(config)]
    assert sorted(name for name in set(fields) if fields.count(name) > 1) == []
    assert {f.name: f.type for f in dataclasses.fields(EDGCConfig)}["engine"] in (LowRankConfig, "LowRankConfig")
    config = EDGCConfig(r_max=8, error_feedback=False, seed=3)  # the flat keywords users give
    assert config.engine == LowRankConfig(error_feedback=False, seed=3)
    assert (config.error_feedback, config.seed) == (False, 3)
    assert EDGCConfig.from_dict(config.to_dict()) == config and "error_feedback" in config.to_dict()
