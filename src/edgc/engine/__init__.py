"""The PowerSGD engine: factors, layouts, its state between steps, rank changes, its device work.

Modules:
    factors.py            Shapes and orthonormalisation of low-rank factors.
    layout.py             How one compression call lays out its tensors: raw ones, shape groups and flat factor
                          buffers.
    call_buffers.py       The buffers one call layout keeps from step to step: what every stretch of its job reads
                          and writes.
    engine_memory.py      What the PowerSGD engine keeps between steps, and how a step's changes are kept or undone.
    rank_change.py        How the warm-start Q of every matrix follows a rank change (`EDGCConfig.engine.rank_change`).
    orthonormal_choice.py Which orthonormalisation the engine runs on a device: timed once, agreed by the group,
                          kept.
    stretches.py          The device work of one engine call, stretch by stretch: each a function over the call's
                          fixed buffers.
    lowrank.py            The PowerSGD engine: rank-r compression with error feedback and warm-started Q, batched by
                          shape.
"""
