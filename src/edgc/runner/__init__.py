"""The step runner's base: what every sync method's steps are made of, beneath the engine and the rank control.

Modules:
    stats.py   `ReduceStats`: what one call sent and how well it compressed.
    seeds.py   Seeds from names and numbers that are the same in every process.
    jobs.py    How a reducer's bucket jobs run: in a fixed order, gathered into batches, on a side stream.
    events.py  What a sync state says through Python's `logging`: logger ``edgc``, one record per event.
"""
