"""Ranks and their groups: the one DeviceMesh, the communication layer, experts' groups, settings agreed.

Modules:
    mesh.py          The one `DeviceMesh` of a run: every process group of a 3D-parallel job comes from it.
    comm.py          Collectives over one process group (or none at all), with a two-rule contract.
    detached.py      What an unpickled gradient-sync state holds in place of its `Communicator`.
    scaling.py       The one place where a gradient's scale is set before a state averages it: the contract an
                     integration builds on.
    experts.py       Mixture-of-experts: which parameters are experts, and over which group each expert's gradient
                     is averaged.
    expert_tokens.py The tokens routed to each expert a state syncs: read from the model's counters, never written.
    expert_sync.py   What one state does with the stacked experts it syncs.
    agreement.py     The settings every rank of a group must hold alike, compared once, before anything depends on
                     them.
"""
