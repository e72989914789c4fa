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


def test_each_setting_is_defined_once_and_flat_keywords_reach_the_nested_engine():
    configs = [EDGCConfig, LowRankConfig]
    fields = [f.name for config in configs for f in dataclasses.fields(config)]
    assert sorted(name for name in set(fields) if fields.count(name) > 1) == []
    assert {f.name: f.type for f in dataclasses.fields(EDGCConfig)}["engine"] in (LowRankConfig, "LowRankConfig")
    config = EDGCConfig(r_max=8, error_feedback=False, seed=3)  # the flat keywords users give
    assert config.engine == LowRankConfig(error_feedback=False, seed=3)
    assert (config.error_feedback, config.seed) == (False, 3)
    assert EDGCConfig.from_dict(config.to_dict()) == config and "error_feedback" in config.to_dict()


def test_sync_methods_sit_at_most_two_classes_below_the_step_runner():
    """A method's behaviour is read in its class and at most one base below the runner (docs/layout.md,
    "Sync methods"); AllocatedSparseState is a SparseQuantState by contract."""
    from edgc.reducer import GradientReducer
    from edgc.sync_methods import SYNC_METHODS

    def below_runner(cls: type) -> int:
        return cls.__mro__.index(GradientReducer)

    methods = {SYNC_METHODS.get(name).reducer for name in SYNC_METHODS.names()} | {EDGCState}
    deep = sorted(cls.__name__ for cls in methods if below_runner(cls) > 2)
    assert deep == ["AllocatedSparseState"], deep
