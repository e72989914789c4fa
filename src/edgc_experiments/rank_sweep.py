"""stub"""
NAME="rank-sweep"
HELP="todo"
DEFAULT_STEPS=10
TINY_STEPS=5
def add_arguments(p):
    pass


def run(args, out, setting, log=print):
    from edgc_cli.main import CLIError

    raise CLIError("not implemented yet")
