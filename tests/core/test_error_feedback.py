"""One error feedback (`edgc.runner.error_feedback.ErrorFeedback`): every class of the library that keeps one
holds it (read from the source with `ast`, and from the objects), its parts behave as each method needs
(rollback modes, entries tied to a layout, decay, drop with a line, flat buffers whose entries are
views), and checkpoints written in the formats before it load and go on bit for bit."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from edgc import EDGCConfig, EDGCState, TopKState
from edgc.parallel.interstage import InterStageCompressor
from edgc.runner.error_feedback import ErrorFeedback
from edgc.sync.sync_methods import sync_method, sync_method_names
from edgc.sync.two_stage import Partition, TwoStageQuantState

LIBRARY = Path(__file__).resolve().parents[2] / "src" / "edgc"
HOME = LIBRARY / "runner" / "error_feedback.py"
HELD = re.compile(r"(^|_)(error|errors|residual|residuals)($|_)")


@pytest.fixture(autouse=True)
def no_process_group_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: each averages over this process alone
        yield


# ------------------------------------------------------------------ who holds one
def _table_valued(node: ast.Assign | ast.AnnAssign) -> bool:
    """The value assigned is a table: a dict display or comprehension, ``dict(...)``, a device move of
    one, or annotated ``dict[...]``."""
    annotation = getattr(node, "annotation", None)
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "dict":
        return True
    value = node.value
    called = getattr(value.func, "id", "") if isinstance(value, ast.Call) else ""
    return isinstance(value, (ast.Dict, ast.DictComp)) or called in ("dict", "state_to_device")


def own_error_tables(tree: ast.Module) -> list[tuple[str, str]]:
    """(class, attribute) of every class that keeps an error feedback table of its own: assigns
    ``self.<error…/residual…>`` a table."""
    found = set()
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for node in ast.walk(cls):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and HELD.search(target.attr)
                    and _table_valued(node)
                ):
                    found.add((cls.name, target.attr))
    return sorted(found)


def test_no_class_of_the_library_keeps_an_error_feedback_table_of_its_own():
    kept = {
        str(path.relative_to(LIBRARY)): own
        for path in sorted(LIBRARY.rglob("*.py"))
        if path != HOME and (own := own_error_tables(ast.parse(path.read_text())))
    }
    assert kept == {}, f"error feedback kept outside ErrorFeedback: {kept}"


@pytest.mark.parametrize(
    "planted",
    [
        "class Planted:\n    def __init__(self):\n        self.error = {}\n",
        "class Planted:\n    def __init__(self):\n        self._residuals: dict[int, object] = {}\n",
        "class Planted:\n    def load(self, state):\n        self.owner_error = dict(state['owner'])\n",
    ],
)
def test_a_class_keeping_its_own_table_is_caught(planted):
    assert own_error_tables(ast.parse(planted)) != []


def _stepped(state, net: nn.Module, steps: int = 1):
    for _ in range(steps):
        net.zero_grad()
        net(torch.randn(4, 16)).square().sum().backward()
        state.synchronize(net.named_parameters())
    return state


@pytest.mark.parametrize("name", sync_method_names())
def test_every_registered_sync_method_keeps_its_error_feedback_in_error_feedback(name):
    net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    state = _stepped(sync_method(name).build(None, model=net), net)
    parts = state.error_feedbacks()
    assert all(isinstance(part, ErrorFeedback) for part in parts)
    if parts:
        assert state.error_table() is parts[0].table
        assert parts[0].enabled or not parts[0].table  # "-noef" keeps none
    else:
        assert state.error_table() == {}


def test_the_engine_and_the_interstage_compressor_hold_error_feedback():
    net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    config = EDGCConfig(
        r_max=2, window=2, total_steps=8, warmup_fraction=0.0, min_warmup_steps=1, warmup_error_test=False
    )
    state = _stepped(EDGCState(None, config, model=net), net, 3)
    assert state.error_feedbacks() == [state.compressor.state.feedback] and state.error_table()
    compressor = InterStageCompressor()
    compressor.compress(0, torch.randn(32, 12), 2)
    assert isinstance(compressor.feedback, ErrorFeedback) and compressor.residuals is compressor.feedback.table


# ------------------------------------------------------------------ its parts
def test_rollback_modes_and_decay_and_a_drop_with_its_line():
    restored, kept = ErrorFeedback(rollback="restore"), ErrorFeedback()
    for feedback in (restored, kept):
        feedback.table["a"] = torch.ones(3)
        snapshot = feedback.snapshot()
        feedback.table["a"] = torch.full((3,), 2.0)
        feedback.restore(snapshot)
    assert torch.equal(restored.table["a"], torch.ones(3)) and torch.equal(kept.table["a"], torch.full((3,), 2.0))
    restored.decay(0.5)
    assert torch.equal(restored.table["a"], torch.full((3,), 0.5))
    said = []
    restored.drop(lambda: said.append("dropped"))
    restored.drop(lambda: said.append("again"))  # nothing left: no line
    assert restored.table == {} and said == ["dropped"]
    with pytest.raises(ValueError, match="rollback"):
        ErrorFeedback(rollback="sometimes")


def test_a_tied_entry_is_dropped_when_another_layout_asks_and_a_flat_buffer_holds_views():
    feedback = ErrorFeedback(layout=lambda saved: tuple(saved))
    changes = []
    current, written = feedback.tied("a", (1, 2), lambda: torch.zeros(4), fresh=False, changed=lambda *c: None)
    written.fill_(3.0)
    again, _ = feedback.tied("a", (1, 2), lambda: torch.zeros(4), fresh=True, changed=lambda *c: None)
    assert torch.equal(again, torch.full((4,), 3.0))
    other, _ = feedback.tied("a", (3, 4), lambda: torch.zeros(2), fresh=False, changed=lambda *c: changes.append(c))
    assert torch.equal(other, torch.zeros(2)) and changes == [((1, 2), (3, 4))]
    assert feedback.by_layout()["a"][0] == (3, 4)
    grads = [torch.zeros(2, 3), torch.zeros(5)]
    flat_one = ErrorFeedback()
    flat = flat_one.flat(["x", "y"], grads, torch.float32)
    flat.fill_(1.0)
    assert torch.equal(flat_one.table["x"], torch.ones(2, 3))  # the entries are views of the buffer
    assert flat_one.flat(["x", "y"], grads, torch.float32) is flat


# ------------------------------------------------------------------ checkpoints written before it
def test_a_sync_method_checkpoint_in_the_earlier_format_loads_and_goes_on_alike():
    names, shapes = ["w", "b"], [(8, 4), (8,)]
    state = TopKState(ratio=0.25)
    error = {n: torch.randn(s) for n, s in zip(names, shapes)}
    saved = {  # the format main wrote before `ErrorFeedback`, written out
        "format": "edgc-baseline/1",
        "method": "topk",
        "step": 3,
        "totals": {"elements_raw": 0, "elements_sent": 0, "bytes_raw": 0, "bytes_sent": 0},
        "world_size": 1,
        "error": {n: e.clone() for n, e in error.items()},
    }
    state.load_state_dict(saved)
    grads = [torch.randn(s) for s in shapes]
    state.reduce_tensors(names, [g.clone() for g in grads], last=True)
    m = torch.cat([(g + error[n]).reshape(-1) for n, g in zip(names, grads)])
    e = torch.cat([state.error[n].reshape(-1) for n in names])
    sent = e != m  # top-k sends a quarter of M (the loaded e included) and keeps the rest
    assert state.step == 4 and int(sent.sum()) == m.numel() // 4 and torch.equal(e[sent], torch.zeros(m.numel() // 4))


def _two_stage_old_format(saved: dict, with_rows: bool) -> dict:
    """``saved`` as main wrote it before `ErrorFeedback`: the owners' error feedback a table of
    (sizes, members, rank, bucket, values[, row multiple]) per call."""
    owners = saved["owner_error"]
    old = {}
    for key, values in owners["error"].items():
        sizes, members, rank, bucket, rows = owners["layouts"][key]
        old[key] = (list(sizes), members, rank, bucket, values.clone(), *((rows,) if with_rows else ()))
    return {**saved, "owner_error": old}


@pytest.mark.parametrize("with_rows", [True, False])
def test_a_two_stage_checkpoint_with_the_owners_earlier_format_loads_and_goes_on_bit_for_bit(with_rows):
    names, shapes = ["a", "b"], [(300, 7), (1000,)]
    torch.manual_seed(0)
    state = TwoStageQuantState(None, bits=3, bucket_values=100 if not with_rows else None)
    state.reduce_tensors(names, [torch.randn(s) for s in shapes], last=True)
    state.owners.table["a"].copy_(torch.randn_like(state.owners.table["a"]))  # a world of one: give it some
    old = _two_stage_old_format(state.state_dict(), with_rows)
    resumed = TwoStageQuantState(None, bits=3, bucket_values=100 if not with_rows else None)
    resumed.load_state_dict(old)
    partition, values = resumed.owner_error["a"]
    assert partition == state.owner_error["a"][0] and isinstance(partition, Partition)
    assert torch.equal(values, state.owner_error["a"][1])
    grads = [torch.randn(s) for s in shapes]
    outs = []
    for target in (state, resumed):
        copies = [g.clone() for g in grads]
        target.reduce_tensors(names, copies, last=True)
        outs.append(copies)
    assert all(torch.equal(x, y) for x, y in zip(*outs))
    assert all(torch.equal(state.error[n], resumed.error[n]) for n in names)


def test_an_interstage_checkpoint_with_the_residuals_key_loads_and_goes_on_bit_for_bit():
    torch.manual_seed(0)
    compressor = InterStageCompressor(seed=1)
    for slot in (0, 1):
        compressor.compress(slot, torch.randn(32, 12), 3)
    saved = compressor.state_dict()
    old = {"residuals": {int(k): v for k, v in saved["error"].items()}, "qs": saved["qs"]}  # main's format
    resumed = InterStageCompressor(seed=1)
    resumed.load_state_dict(old)
    assert sorted(resumed.residuals) == [0, 1]
    grad = torch.randn(32, 12)
    assert torch.equal(compressor.compress(1, grad, 3).payload, resumed.compress(1, grad, 3).payload)
    assert torch.equal(compressor.residuals[1], resumed.residuals[1])
