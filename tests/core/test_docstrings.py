"""The public API reads as Google-style docstrings (what `sphinx.ext.napoleon` renders in docs/api.md), and
no docstring of the library is cut off mid-sentence.

Which names: every name of ``edgc.__all__``; for `edgc.integrations` and each of its modules (but the
``*_adapter`` ones, which read a third party's private members for the others and are internal, as
`edgc.adapters` is), the names of its ``__all__`` or, without one, the classes and functions it defines
whose names have no leading underscore. Of each public class, every public method it defines in its own
body (properties read as attributes and are left out; inherited methods are checked where defined).

The rules for each of those callables:

- a docstring;
- ``Args:`` names every parameter but ``self``/``cls``/``*args``/``**kwargs``: a function's own, a class's
  ``__init__``'s (in the class's docstring or its ``__init__``'s). A dataclass needs no ``Args:``: each
  field has its one-line docstring (`edgc.field_docs`), which autodoc shows. A class whose ``__init__``
  comes from a base outside edgc (an exception, Lightning's strategy), or whose docstring names the edgc
  base its ``__init__`` comes from, has no arguments of its own to document;
- ``Returns:`` (or ``Yields:``) where the function returns a value: its return annotation is not None,
  or, without one, a ``return`` of its own gives a value. Its first line has no colon outside code:
  napoleon would render the text before it as the return type.

A docstring is cut off when its last line does not end a sentence (``.``, ``?`` or ``!``, maybe before a
closing bracket or quote), or when an entry of a package's module listing (``name.py  what it holds``)
does not: for every module and package docstring of ``src/edgc`` and every docstring checked above.
"""

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
import textwrap
from pathlib import Path

import edgc
import edgc.integrations

LIBRARY = Path(edgc.__file__).resolve().parent
SENTENCE_END = re.compile(r"[.?!][)\]\"'`*]*$")
LISTING_ENTRY = re.compile(r"^ {4}[\w.]+(?:\.py|/)\s+\S")
ARG_ENTRY = re.compile(r"^\**(\w+)(?: \([^)]*\))?:(?:\s|$)")
SECTION = re.compile(r"^(\w[\w ]*):$")
CODE = re.compile(r"``[^`]*``|`[^`]*`")


def integration_modules() -> list:
    names = [
        m.name
        for m in pkgutil.iter_modules(edgc.integrations.__path__)
        if not m.name.startswith("_") and not m.name.endswith("_adapter")
    ]
    return [edgc.integrations, *(importlib.import_module(f"edgc.integrations.{name}") for name in sorted(names))]


def module_public(module) -> dict[str, object]:
    if hasattr(module, "__all__"):
        names = {name: getattr(module, name) for name in module.__all__}
    else:
        names = {
            name: value
            for name, value in vars(module).items()
            if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ == module.__name__
        }
    return {
        f"{module.__name__}.{name}": value
        for name, value in names.items()
        if not name.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value))
    }


def public_names() -> dict[str, object]:
    names = module_public(edgc)
    for module in integration_modules():
        names.update(module_public(module))
    return names


def public_methods(name: str, cls: type) -> dict[str, object]:
    """The public methods ``cls`` defines in its own body (static and class methods included)."""
    found = {}
    for method_name, member in vars(cls).items():
        function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        if not method_name.startswith("_") and inspect.isfunction(function):
            found[f"{name}.{method_name}"] = function
    return found


def sections(doc: str) -> dict[str, list[str]]:
    """A docstring's Google-style sections: header → the lines indented beneath it."""
    found, current = {}, None
    for line in inspect.cleandoc(doc).splitlines():
        header = SECTION.match(line)
        if header:
            current = found.setdefault(header.group(1), [])
        elif current is not None and (line.startswith(" ") or not line.strip()):
            current.append(line)
        else:
            current = None
    return found


def documented_args(doc: str) -> set[str]:
    """The parameters an ``Args:`` section names (its entries: ``name: …`` or ``name (type): …``)."""
    lines = [line for line in sections(doc).get("Args", []) if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in lines), default=0)
    entries = (ARG_ENTRY.match(line[indent:]) for line in lines if not line[indent].isspace())
    return {entry.group(1) for entry in entries if entry}


def own_nodes(function: ast.AST):
    """The nodes of ``function``'s body, not those of the functions or classes defined in it."""
    for child in ast.iter_child_nodes(function):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from own_nodes(child)


def returns_value(function) -> bool:
    annotation = inspect.signature(function).return_annotation
    if annotation is not inspect.Signature.empty:
        return annotation not in (None, "None")
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    return any(isinstance(node, ast.Return) and node.value is not None for node in own_nodes(tree.body[0]))


def problems_of_function(name: str, function, doc: str | None, *, returns: bool = True) -> list[str]:
    if not doc or not doc.strip():
        return [f"{name}: no docstring"]
    found = []
    skipped = ("self", "cls")
    parameters = inspect.signature(function).parameters.values()
    named = [p.name for p in parameters if p.name not in skipped and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    missing = [p for p in named if p not in documented_args(doc)]
    if missing:
        found.append(f"{name}: Args: lacks {missing}")
    if returns and returns_value(function) and not {"Returns", "Yields"} & set(sections(doc)):
        found.append(f"{name}: no Returns:")
    for section in ("Returns", "Yields"):
        first = next((line for line in sections(doc).get(section, []) if line.strip()), "")
        if re.search(r"(?<!:):(?!:)", CODE.sub("", first)):
            found.append(f"{name}: {section}: a colon in its first line (napoleon reads a type before it)")
    return found


def constructor_doc(cls: type) -> tuple[object, str] | None:
    """The ``__init__`` whose arguments ``cls``'s documentation must name, and that documentation; None
    where it has none of its own to name (a dataclass, an ``__init__`` from outside edgc or explained
    at the edgc base named in the class's docstring)."""
    owner = next(c for c in cls.__mro__ if "__init__" in vars(c))
    inherited = owner is not cls and re.search(rf"`[\w.]*\b{owner.__name__}`", cls.__doc__ or "")
    if dataclasses.is_dataclass(cls) or owner.__module__.split(".")[0] != "edgc" or inherited:
        return None
    own_init = vars(cls).get("__init__")
    docs = [cls.__doc__ or "", (own_init.__doc__ or "") if own_init else ""]
    return owner.__init__, "\n\n".join(inspect.cleandoc(doc) for doc in docs)


def problems_of_class(name: str, cls: type) -> list[str]:
    if not cls.__doc__ or not cls.__doc__.strip():
        return [f"{name}: no docstring"]
    found = []
    constructor = constructor_doc(cls)
    if constructor is not None:
        found += problems_of_function(name, *constructor, returns=False)
    if dataclasses.is_dataclass(cls):
        from edgc.config import field_docs

        undocumented = [field for field, _, doc in field_docs(cls) if not doc]
        found += [f"{name}: fields without a docstring {undocumented}"] if undocumented else []
    for method_name, method in public_methods(name, cls).items():
        found += problems_of_function(method_name, method, method.__doc__)
    return found


def test_every_public_name_has_google_style_args_and_returns():
    problems = []
    for name, value in sorted(public_names().items()):
        if inspect.isclass(value):
            problems += problems_of_class(name, value)
        else:
            problems += problems_of_function(name, value, value.__doc__)
    assert problems == [], f"{len(problems)} problem(s):\n" + "\n".join(problems)


def cut_off(doc: str) -> list[str]:
    """The lines of ``doc`` that end the docstring or a module listing's entry without ending a sentence."""
    lines = inspect.cleandoc(doc).rstrip().splitlines()
    ends = [lines[-1]]
    for i, line in enumerate(lines):
        if LISTING_ENTRY.match(line):  # the entry runs on over the deeper-indented lines below it
            j = i + 1
            while j < len(lines) and lines[j].startswith(" " * 6) and not LISTING_ENTRY.match(lines[j]):
                j += 1
            ends.append(lines[j - 1])
    return sorted({end.strip() for end in ends if not SENTENCE_END.search(end.rstrip())})


def checked_docstrings() -> dict[str, str | None]:
    """Every module's and package's docstring under src/edgc, and those of the public names and methods."""
    docs = {
        str(path.relative_to(LIBRARY)): ast.get_docstring(ast.parse(path.read_text()), clean=False)
        for path in sorted(LIBRARY.rglob("*.py"))
    }
    for name, value in public_names().items():
        docs[name] = value.__doc__
        if inspect.isclass(value):
            docs.update({method: function.__doc__ for method, function in public_methods(name, value).items()})
    return docs


def test_no_module_or_public_docstring_is_cut_off_mid_sentence():
    cut = {}
    for name, doc in checked_docstrings().items():
        if doc is None and name.endswith(".py"):
            cut[name] = ["(no module docstring)"]
        elif doc and cut_off(doc):
            cut[name] = cut_off(doc)
    assert cut == {}, "end each docstring, and each entry of a module listing, with a full sentence"


def test_the_rules_catch_what_they_are_for():
    def documented(a: int, b: int, *rest: int) -> int:
        """Add.

        Args:
            a: one.
            b (int): the other,
                on two lines.

        Returns:
            The sum.
        """
        return a + b

    def undocumented(a: int, b: int):
        """Add ``a`` and ``b``: a is one."""
        return a + b

    class Documented:
        """A pair.

        Args:
            a: one.
        """

        __module__ = "edgc.pairs"  # as if the library defined it: its constructor's arguments are asked for

        def __init__(self, a: int, b: int):
            """Keep them.

            Args:
                b: the other.
            """

    assert problems_of_function("f", documented, documented.__doc__) == []
    typed = documented.__doc__.replace("The sum.", "int: the sum.")
    assert problems_of_function("f", documented, typed) == [
        "f: Returns: a colon in its first line (napoleon reads a type before it)"
    ]
    assert problems_of_function("g", undocumented, undocumented.__doc__) == [
        "g: Args: lacks ['a', 'b']",
        "g: no Returns:",
    ]
    assert constructor_doc(Documented) is not None and problems_of_class("C", Documented) == []
    Documented.__init__.__doc__ = None
    assert problems_of_class("C", Documented) == ["C: Args: lacks ['b']"]
    listing = "A package.\n\nModules:\n    a.py    what it holds, and the parts of\n    b.py    all of it.\n"
    assert cut_off(listing) == ["a.py    what it holds, and the parts of"]
    assert cut_off("One sentence, then half of") == ["One sentence, then half of"]
