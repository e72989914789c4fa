"""The step runner: what every sync method's steps are made of, beneath the engine and the rank control.

Modules:
    error_feedback.py  `ErrorFeedback`: the one error feedback every method that keeps one holds.
    stats.py        `ReduceStats`: what one call sent and how well it compressed.
    seeds.py        Seeds from names and numbers that are the same in every process.
    jobs.py         How a reducer's bucket jobs run: in a fixed order, gathered into batches, on a side stream.
    events.py       What a sync state says through Python's `logging`: logger ``edgc``, one record per event.
    steps.py        One optimizer step as a `GradientReducer` keeps it: a `StepRecord`, and the metrics of a
                    settled one.
    gradients.py    The gradients a reducer is handed, of every kind, and how each is averaged raw.
    step_cycle.py   `StepCycle`: one optimizer step's cycle as every sync method runs it, the base of
                    `GradientReducer`.
    reducer.py      `GradientReducer`: the one abstraction every gradient-sync method implements, and its DDP
                    hook.
"""
