"""Ranks and their groups: the one DeviceMesh, the communication layer, experts' groups, settings agreed.

Modules:
    mesh.py      The one `DeviceMesh` of a run: every process group of a 3D-parallel job comes from it.
    comm.py      Collectives over one process group (or none at all), with a two-rule contract.
    detached.py  What an unpickled gradient-sync state holds in place of its `Communicator`.
    experts.py   Mixture-of-experts: each expert's gradient averaged over its expert-data-parallel group, as a
                 matrix of its own.
    agreement.py The settings every rank of a group must hold alike, compared once, before anything depends on them.
"""
