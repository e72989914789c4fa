"""The source tree's shape: no import circles, every package's docstring names its modules, and one
place builds process groups by hand. Read from the source with `ast` (nothing is imported)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def imports_of(name: str, path: Path) -> set[str]:
    """The src modules ``name`` imports anywhere in its body (function-level imports included).

    ``from pkg import x`` counts as importing the module ``pkg.x`` when that is a module, else
    ``pkg``; the implicit import of a module's parent packages does not count. A call of
    ``import_module`` (``importlib.import_module``) with a literal name counts as an import of it,
    and so does every literal module name in a dict or tuple handed to it by name (the command's
    table of tools), so a cycle cannot hide behind importlib."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    dynamic_names = literal_module_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    found.add(f"{source}.{alias.name}")
                elif source in MODULES:
                    found.add(source)
        elif (
            isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        ):
            found |= {arg.value for arg in node.args if isinstance(arg, ast.Constant) and arg.value in MODULES}
            found |= dynamic_names
    found.discard(name)
    return found


def literal_module_names(tree: ast.AST) -> set[str]:
    """Every string constant of a module that names a src module (candidates for import_module)."""
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in MODULES}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


# The layers, from the bottom; a module may import its own layer or one below, never one above.
# `edgc_probes` (the counters and checkers the tests and the bench share) imports only the library;
# `edgc_cli.errors` sits beneath the tools that raise its error, `edgc_cli.main` above all of them.
LAYERS = [
    "edgc",
    "edgc_probes",
    "edgc_cli.errors",
    "edgc_train",
    "edgc_sim",
    "edgc_bench",
    "edgc_experiments",
    "edgc_cli.main",
]


def layer(module: str) -> int:
    """The index in LAYERS of the longest entry that is ``module`` or a package containing it."""
    matches = [i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module}: in no layer of LAYERS"
    return max(matches, key=lambda i: len(LAYERS[i]))


def test_no_import_runs_up_the_layers():
    upward = sorted(
        (name, dep) for name, path in MODULES.items() for dep in imports_of(name, path) if layer(dep) > layer(name)
    )
    assert upward == [], upward


def test_the_probes_import_only_the_library_and_the_bench_measures_with_them():
    probes = {name: path for name, path in MODULES.items() if name.split(".")[0] == "edgc_probes"}
    reached = {dep.split(".")[0] for name, path in probes.items() for dep in imports_of(name, path)}
    assert reached <= {"edgc", "edgc_probes"}, reached
    bench = {dep for name, path in MODULES.items() if name.startswith("edgc_bench") for dep in imports_of(name, path)}
    assert {"edgc_probes.dispatch_count", "edgc_probes.host_reads", "edgc_probes.participation"} <= bench


TESTS = SRC.parent / "tests"
BENCH_TESTS = ("bench", "gpu")  # the bench's own tests, and the GPU's (run by `python -m edgc_bench.gpu`)


def bench_uses(path: Path) -> list[tuple[int, str]]:
    """(line, what) of each use of `edgc_bench` in a test file: an import anywhere in it (inside a
    function too), or a string that names one of its modules or runs one (``-m edgc_bench.gpu``),
    docstrings aside (they may say which command made a committed figure)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "edgc_bench"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "edgc_bench":
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if re.fullmatch(r"edgc_bench(\.\w+)+", node.value) or re.search(r"-m\s+edgc_bench\b", node.value):
                found.append((node.lineno, node.value))
        elif (
            isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        ):
            found += [
                (node.lineno, a.value) for a in node.args if isinstance(a, ast.Constant) and a.value == "edgc_bench"
            ]
    return found


def test_only_the_bench_and_gpu_tests_use_the_bench():
    """The other tests count and check with `edgc_probes`; what they test of the bench lives in tests/bench."""
    used = {
        f"{path.relative_to(TESTS)}:{line}": what
        for path in TESTS.rglob("*.py")
        if path.relative_to(TESTS).parts[0] not in BENCH_TESTS
        for line, what in bench_uses(path)
    }
    assert used == {}, used


def test_a_bench_use_is_found_inside_a_function_and_in_a_command_line(tmp_path):
    path = tmp_path / "test_m.py"
    text = (
        '''"""Counted by `python -m BENCH.gpu` (a docstring: not a use)."""\n'''
        "def test_f():\n    from BENCH.run import all_methods\n    importlib.import_module('BENCH')\n"
        "    run(['python', '-m', 'BENCH.gpu'])\n    run('python -m BENCH.gpu --smoke')\n"
    )
    path.write_text(text.replace("BENCH", "edgc_bench"))  # this file names none, so the check passes over it
    uses = [(line, what.replace("edgc_bench", "BENCH")) for line, what in sorted(bench_uses(path))]
    assert uses == [(3, "BENCH.run"), (4, "BENCH"), (5, "BENCH.gpu"), (6, "python -m BENCH.gpu --smoke")]


def test_an_import_module_call_with_a_literal_name_is_an_import(tmp_path, monkeypatch):
    path = tmp_path / "m.py"
    path.write_text(
        "import importlib\nTOOLS = {'a': 'edgc_train.cli'}\n"
        "def f(name):\n    importlib.import_module(name)\n    return importlib.import_module('edgc.state')\n"
    )
    assert imports_of("edgc_probe", path) == {"edgc_train.cli", "edgc.state"}
    assert layer("edgc_cli.main") > layer("edgc_experiments.cli") > layer("edgc_cli.errors") > layer("edgc.state")


def test_the_cycle_finder_finds_a_circle_through_a_third_module():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_that_imports_it_back():
    graph = {name: imports_of(name, path) for name, path in MODULES.items()}
    assert import_cycles(graph) == []


def library_part(module: str) -> str:
    """The part of the library a module belongs to: its sub-package (``edgc.engine``), or itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_librarys_parts_import_one_way():
    """The library's sub-packages and top-level modules form no circle among themselves: each part
    stands above the parts it uses (the order of `edgc`'s docstring, docs/layout.md). `edgc` itself
    (the public face) stands above all."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if name.split(".")[0] != "edgc" or name == "edgc":
            continue
        deps = {library_part(dep) for dep in imports_of(name, path) if dep != "edgc"}
        graph.setdefault(library_part(name), set()).update(deps - {library_part(name)})
    graph = {part: {dep for dep in deps if dep in graph} for part, deps in graph.items()}
    assert import_cycles(graph) == []


def test_every_package_docstring_names_exactly_its_modules():
    for init in SRC.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        named = set(re.findall(r"\b(\w+\.py)\b", doc))
        present = {p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"}
        subpackages = {p.parent.name for p in init.parent.glob("*/__init__.py")}
        assert present <= named, f"{init}: docstring does not name {sorted(present - named)}"
        assert named <= present, f"{init}: docstring names missing modules {sorted(named - present)}"
        assert all(f"{sub}/" in doc for sub in subpackages), f"{init}: name its sub-packages ({sorted(subpackages)})"


def calls_new_group(path: Path) -> bool:
    return any(
        isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "new_group"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_process_groups_are_built_in_one_place():
    """Every group of a run comes from the DeviceMesh; `new_group` only where the mesh has no dimension for it."""
    builders = sorted(str(p.relative_to(SRC)) for p in MODULES.values() if calls_new_group(p))
    assert builders in ([], ["edgc/distributed/mesh.py"]), builders


def test_the_layout_page_names_every_module_under_its_package():
    layout = (SRC.parent / "docs" / "layout.md").read_text()
    bullets = {b.split("`")[1]: b for b in layout.split("\n- ")[1:] if b.startswith("`src/")}
    for init in SRC.glob("*/__init__.py"):
        package = init.parent
        bullet = bullets.get(f"src/{package.name}/", "")
        missing = sorted(
            str(p.relative_to(package))
            for p in package.rglob("*.py")
            if p.name != "__init__.py" and f"`{p.name}`" not in bullet
        )
        assert not missing, f"docs/layout.md's bullet for src/{package.name}/ does not name {missing}"


def test_the_harness_lists_its_modules_in_import_order():
    """edgc_train's docstring promises that each module imports only modules listed below it."""
    doc = ast.get_docstring(ast.parse((SRC / "edgc_train" / "__init__.py").read_text()))
    position = {f"edgc_train.{m}": i for i, m in enumerate(re.findall(r"^\s+(\w+)\.py", doc, re.M))}
    upward = [
        (m, dep)
        for m, i in position.items()
        for dep in imports_of(m, MODULES[m])
        if position.get(dep, len(position)) < i
    ]
    assert not upward, upward
