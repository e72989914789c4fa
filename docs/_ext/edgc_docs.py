"""Sphinx directives that render tables from the code itself, so the manual cannot drift from it.

``{edgc-config} edgc`` renders every `EDGCConfig` field from `edgc.config.field_docs` (the same
docstrings `EDGCConfig` validates against); ``{edgc-config} train`` every `TrainConfig` field from
`edgc_train.config.field_help`, the text of `edgc train --help`.
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


def setup(app):
    app.add_directive("edgc-config", ConfigTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
