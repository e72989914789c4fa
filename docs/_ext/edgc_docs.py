"""Sphinx directives that render tables from the code itself, so the manual cannot drift from it.

``{edgc-config} edgc`` renders every `EDGCConfig` field from `edgc.config.field_docs` (the same
docstrings `EDGCConfig` validates against); ``{edgc-config} train`` every `TrainConfig` field from
`edgc_train.config.field_help`, the text of `edgc train --help`.

An attribute's or a property's docstring is rendered as written: `sphinx.ext.napoleon` reads the Google
sections of functions and classes, but would take an attribute's text before its first colon for its type.
"""

from __future__ import annotations

import dataclasses

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


def train_config_table() -> str:
    from edgc_train.config import TrainConfig, field_help

    docs = field_help()
    rows = ["| flag of `edgc train` | default | meaning, unit, valid range |", "| --- | --- | --- |"]
    for field in dataclasses.fields(TrainConfig):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        doc = docs.get(field.name, "").replace("|", "∣")
        rows.append(f"| `--{field.name.replace('_', '-')}` | `{default!r}` | {doc} |")
    return "\n".join(rows)


class ConfigTable(SphinxDirective):
    required_arguments = 1

    def run(self):
        from edgc.config import config_table_markdown

        tables = {"edgc": config_table_markdown, "train": train_config_table}
        if self.arguments[0] not in tables:
            raise self.error(f"edgc-config: unknown table {self.arguments[0]!r} (one of {sorted(tables)})")
        container = nodes.container()
        self.state.nested_parse(
            StringList(tables[self.arguments[0]]().splitlines(), source=self.get_source_info()[0]),
            self.content_offset,
            container,
        )
        return container.children


ATTRIBUTE_KINDS = ("attribute", "property", "data")
_as_written: dict[str, list[str]] = {}


def keep_attribute_docstring(app, what, name, obj, options, lines) -> None:
    """Before napoleon (priority 500): an attribute's docstring as written."""
    if what in ATTRIBUTE_KINDS:
        _as_written[name] = list(lines)


def restore_attribute_docstring(app, what, name, obj, options, lines) -> None:
    """After napoleon: the attribute's docstring back as written."""
    if what in ATTRIBUTE_KINDS and name in _as_written:
        lines[:] = _as_written.pop(name)


def setup(app):
    app.add_directive("edgc-config", ConfigTable)
    app.connect("autodoc-process-docstring", keep_attribute_docstring, priority=400)
    app.connect("autodoc-process-docstring", restore_attribute_docstring, priority=600)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
