"""What keeps a run honest: misuse refused, replicas compared, checkpoints checked.

Modules:
    guards.py      How a gradient-sync state is used, checked where a mistake would otherwise pass in silence.
    fingerprint.py The replica fingerprint: what must be identical on every rank of a group, compared once per
                   window.
    checkpoint.py  What an `EDGCState` checkpoint holds, and the checks a loaded one passes before anything changes.
"""
