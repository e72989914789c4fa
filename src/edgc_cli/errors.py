"""`CLIError`, the one user error every tool raises: beneath the tools, so that they need not import
the command (`edgc_cli.main`), which imports every tool."""


class CLIError(Exception):
    """A user error: printed as one line, exit code 2, no traceback."""
