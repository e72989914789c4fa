"""The library's shape by composition, held so that it cannot drift back: a state that owns a few
collaborators, no class on two library bases, short functions, one definition per setting, no
private member of another object reached across modules, ruff's checks alike on every file. Read
from the source with `ast` where it can be, and from one small state that has stepped."""

from __future__ import annotations

import ast
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

from edgc import EDGCConfig, EDGCState, LowRankCompressor, LowRankConfig
from edgc.engine.engine_memory import EngineMemory

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
    import edgc.device.timing
    from edgc.device.totals import StepTotals

    reads = []
    monkeypatch.setattr(edgc.device.timing, "to_host", lambda tensor: reads.append(tensor) or tensor.tolist())
    totals = StepTotals()
    totals.add_vector(("probe_error_sq", "probe_norm_sq"), torch.tensor([3.0, 4.0], dtype=torch.float64))
    totals.add(nonfinite=torch.tensor(False), error_sq=torch.tensor(1.5), norm_sq=6.0)
    totals.send(torch.device("cpu"))
    with pytest.raises(RuntimeError):
        totals.add(late=1.0)  # sent: nothing more
    totals.read()
    totals.read()
    assert len(reads) == 1 and reads[0].shape == (4,)  # one tensor (Python numbers stay on the host), one read
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
    assert not issubclass(LowRankCompressor, EngineMemory)  # the compressor holds its state
    assert isinstance(LowRankCompressor(LowRankConfig()).state, EngineMemory)


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


def long_library_files() -> dict[str, int]:
    """The files docs/layout.md names as past the limit, with the lines each may hold (its table between
    the ``long-files`` marks): each file named there with its reason, or held to the limit."""
    text = (ROOT / "docs" / "layout.md").read_text()
    table = text.split("<!-- long-files:start -->")[1].split("<!-- long-files:end -->")[0]
    rows = [line.split("|")[1:3] for line in table.strip().splitlines()[2:]]
    return {path.strip().strip("`"): int(lines) for path, lines in rows}


def all_trees() -> dict[str, ast.Module]:
    """Every package's modules and the scripts, by path from the repository root."""
    paths = [p for package in PACKAGES for p in package.rglob("*.py")] + sorted((ROOT / "scripts").rglob("*.py"))
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
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and len(self_attributes(node)) > MAX_CLASS_ATTRIBUTES
    }
    assert wide == set(), "give it parts: objects it owns, each holding what belongs together"


def test_no_file_is_longer_than_400_lines_but_the_named_library_ones():
    named = long_library_files()
    length = {path: len((ROOT / path).read_text().splitlines()) for path in all_trees()}
    assert {
        path for path in named if not path.startswith("src/edgc/") or length.get(path, 0) <= MAX_FILE_LINES
    } == set(), "docs/layout.md names a file that is not a library file past the limit: drop its row"
    long = {path for path, lines in length.items() if lines > named.get(path, MAX_FILE_LINES)}
    assert long == set(), "split it by meaning into modules of the same package"


def test_each_setting_is_defined_once_and_spelled_one_way_nested_in_its_engine():
    configs = [EDGCConfig, LowRankConfig]
    fields = [f.name for config in configs for f in dataclasses.fields(config)]
    assert sorted(name for name in set(fields) if fields.count(name) > 1) == []
    assert {f.name: f.type for f in dataclasses.fields(EDGCConfig)}["engine"] in (LowRankConfig, "LowRankConfig")
    config = EDGCConfig(r_max=8, engine=LowRankConfig(error_feedback=False, seed=3))
    assert (config.engine.error_feedback, config.engine.seed) == (False, 3)
    assert not hasattr(config, "error_feedback") and not hasattr(config, "seed")
    with pytest.raises(TypeError, match="seed"):
        EDGCConfig(seed=3)  # type: ignore[call-arg]
    assert EDGCConfig.from_dict(config.to_dict()) == config and "error_feedback" in config.to_dict()["engine"]


# The modules that may read another library's private members, one per library: each docstring names
# what it reads and why, so that a rename upstream changes one file.
LIBRARY_ADAPTERS = {
    "edgc/adapters/torch_adapter.py",
    "edgc/adapters/fsdp_adapter.py",
    "edgc/integrations/torchft_adapter.py",
    "edgc/integrations/torchtitan_adapter.py",
}
FIRST_PARTY = ("edgc", "edgc_probes", "edgc_train", "edgc_bench", "edgc_sim", "edgc_experiments", "edgc_cli")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def third_party_imports(tree: ast.Module) -> set[str]:
    """The names a module binds by importing another library (a library's module-level names are its API)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
            names -= {alias.asname or alias.name for alias in node.names if alias.name.startswith(FIRST_PARTY)}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith(FIRST_PARTY):
            names |= {alias.asname or alias.name for alias in node.names}
    for node in tree.body:  # a module-level alias of a library's namespace (``aten = torch.ops.aten``)
        if isinstance(node, ast.Assign) and isinstance(root := root_of(node.value), ast.Name) and root.id in names:
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return names


def own_private_names(tree: ast.Module) -> set[str]:
    """The private names this module defines: its functions, classes and their members."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    return {name for name in names if is_private(name)}


def root_of(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def foreign_private_reaches(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, expression) of each ``x._name`` read or assigned where ``_name`` is another module's or
    another library's member: ``x`` is not ``self``, ``cls`` or ``super()``, this module defines no
    ``_name``, and ``x`` is not a name imported from another library (``torch._foreach_add_``)."""
    imported, own = third_party_imports(tree), own_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)) or node.attr in own:
            continue
        base, root = node.value, root_of(node.value)
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            continue
        if isinstance(root, ast.Name) and root.id in imported:
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_private_reach_finder_sees_another_objects_members_only():
    tree = ast.parse(
        "import torch\nfrom .reducer import GradientReducer\n"
        "class A:\n    def _own(self):\n        self._x = 1\n"
        "def f(state, other: A):\n"
        "    state._guard.first_use(state)\n    state.comm._pg = None\n    other._own()\n    other._x\n"
        "    super()._snapshot()\n    torch._foreach_add_([], [])\n    GradientReducer._reduce\n"
    )
    assert [text for _, text in sorted(foreign_private_reaches(tree))] == [
        "state._guard",
        "state.comm._pg",
        "GradientReducer._reduce",
    ]


def test_no_module_reaches_into_another_objects_private_members():
    """Across src/, a part is used through what it offers; what must be read inside PyTorch, FSDP2 or
    torchft is read in that library's adapter module alone."""
    source = LIBRARY.parent
    reaches = [
        f"{path.relative_to(source)}:{line}: {text}"
        for path in sorted(source.rglob("*.py"))
        if str(path.relative_to(source)) not in LIBRARY_ADAPTERS
        for line, text in foreign_private_reaches(ast.parse(path.read_text()))
    ]
    assert reaches == [], "use a public method of that part, or the library's adapter module"


def test_ruff_checks_every_file_alike():
    """No per-file exemption from ruff's checks: neither in pyproject.toml nor a file's own ``ruff: noqa``."""
    root = LIBRARY.parents[1]
    assert "per-file-ignores" not in (root / "pyproject.toml").read_text()
    exempt = [
        str(path.relative_to(root))
        for folder in ("src", "tests", "scripts", "examples", "docs")
        for path in (root / folder).rglob("*.py")
        if any(line.lstrip().startswith(("# ruff: noqa", "# flake8: noqa")) for line in path.read_text().splitlines())
    ]
    assert exempt == []


def test_sync_methods_sit_at_most_two_classes_below_the_step_runner():
    """A method's behaviour is read in its class and at most one base below the runner (docs/layout.md,
    "Sync methods"); AllocatedSparseState is a SparseQuantState by contract."""
    from edgc.runner.reducer import GradientReducer
    from edgc.sync.sync_methods import SYNC_METHODS

    def below_runner(cls: type) -> int:
        return cls.__mro__.index(GradientReducer)

    methods = {SYNC_METHODS.get(name).reducer for name in SYNC_METHODS.names()} | {EDGCState}
    deep = sorted(cls.__name__ for cls in methods if below_runner(cls) > 2)
    assert deep == ["AllocatedSparseState"], deep
