"""The `edgc` console command.

Modules:
    main.py         one sub-command per tool, each registered lazily from its own package
    errors.py       `CLIError`, the user error every tool raises (beneath the tools)
"""
