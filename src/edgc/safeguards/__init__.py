"""What keeps a run honest: misuse refused, replicas compared.

Modules:
    guards.py      How a gradient-sync state is used, checked where a mistake would otherwise pass in silence.
    fingerprint.py The replica fingerprint: what must be identical on every rank of a group, compared once per
                   window.
"""
