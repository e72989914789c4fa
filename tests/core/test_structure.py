"""The library's shape by composition, held so that it cannot drift back: a state that owns a few
collaborators, no class on two library bases, short functions, one definition per setting. Read
from the source with `ast` where it can be, and from one small state that has stepped."""

from __future__ import annotations

import ast
import dataclasses
import warnings
from pathlib import Path

import pytest
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
    controller = sorted(vars(state.controller))  # private ones count too: grouped where they belong together
    assert len(controller) <= MAX_STATE_ATTRIBUTES, controller


def test_the_end_of_a_step_is_one_named_value_read_once(monkeypatch):
    import edgc.timing
    from edgc.steps import StepTotals

    reads = []
    monkeypatch.setattr(edgc.timing, "to_host", lambda tensor: reads.append(tensor) or tensor.tolist())
    totals = StepTotals()
    totals.add_vector(("probe_error_sq", "probe_norm_sq"), torch.tensor([3.0, 4.0], dtype=torch.float64))
    totals.add(nonfinite=torch.tensor(False), error_sq=torch.tensor(1.5), norm_sq=6.0)
    totals.send(torch.device("cpu"))
    with pytest.raises(RuntimeError):
        totals.add(late=1.0)  # sent: nothing more
    totals.read()
    totals.read()
    assert len(reads) == 1 and reads[0].shape == (5,)  # one tensor, one read
    assert (totals["norm_sq"], totals["probe_norm_sq"], totals.get("nonfinite")) == (6.0, 4.0, 0.0)
    assert "probe_error_sq" in totals and "absent" not in totals and totals.get("absent") == 0.0
    with pytest.raises(ValueError):
        StepTotals().add_vector(("one",), torch.zeros(2, dtype=torch.float64))
    twice = StepTotals()
    twice.add(norm_sq=1.0)
    with pytest.raises(ValueError):
        twice.add(norm_sq=2.0)


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
