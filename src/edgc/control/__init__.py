"""Rank control: GDS sampling, the byte budget, sync-time profiles, DAC's window and decision round.

Modules:
    entropy.py      GDS — the gradient data sampler: cheap gradient-entropy estimates.
    gather.py       One sampled step's gradient sample, gathered with one gather per buffer its tensors lie in.
    histogram.py    Entropy estimates of a gradient sample on the device: no atomics into few bins, no host read, no
                    size that depends on the values.
    budget.py       The byte budget: spend a mean rank over the compressed steps, more of it early (pure logic).
    profiling.py    Sync-time tables: {rank → measured gradient-sync time}, the r_max rule, interpolation.
    alignment.py    DAC stage alignment: per-pipeline-stage ranks so all stages finish gradient sync together.
    rank_control.py DAC, the window controller: when to compress and at which rank (pure logic, no collectives).
    decisions.py    The decision round: how what the ranks measured becomes one decision that every rank applies.
    shadow.py       What profiling measures: a compressed sync timed beside the real one, and the plain sync's time.
    checkpoint.py   What an `EDGCState` checkpoint holds, and the checks a loaded one passes before anything changes.
    events.py       What EDGC's rank control decides, said through the ``edgc`` logger (`edgc.runner.events`).
"""
