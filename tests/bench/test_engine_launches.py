"""`python -m edgc_bench.engine_launches`'s table (docs/engine/launches.json) against the engine's own
dispatches, counted afresh (the rest of the simulator's engine model: tests/sim/test_engine_model.py)."""

import pytest

from edgc_bench.engine_launches import count_job
from edgc_sim import engine_launches as el
from edgc_sim import engine_model as em

JOBS = {
    "one matrix": [(1600, 6400)],
    "a wide and a tall matrix, one block each": [(1600, 6400), (6400, 1600), (1600,)],
    "three long sides, two short ones": [(512, 2048), (512, 1536), (256, 512), (2048, 512), (512,), (64, 4, 4)],
    "same shapes, many matrices": [(256, 1024)] * 6 + [(1024,)] * 3,
    "nothing worth compressing": [(4, 512), (512,), (2, 3)],
    "a GPT-2 block's raw tensors, more than one gather": [(768, 2304), (768, 768)] + [(768,)] * 140,
}


@pytest.mark.parametrize("name", sorted(JOBS))
@pytest.mark.parametrize(
    "setting",
    [
        el.Setting(True, True, False, False, True),  # the GPU bench's hook step (docs/gpu/count)
        el.Setting(True, False, True, True, False),
        el.Setting(False, False, True, False, True),  # a CPU run in a process group
        el.Setting(False, True, True, True, False),
    ],
    ids=lambda setting: setting.key,
)
def test_job_launches_are_the_engines_dispatches(name, setting):
    """The committed table (docs/engine/launches.json, fitted on other jobs) gives the dispatches the
    engine issues now for jobs it was not fitted on: recount with `python -m edgc_bench.engine_launches`
    after changing the engine."""
    shapes, rank = JOBS[name], 32
    modelled = em.job_launches(
        em.JobLayout.plan(shapes, rank),
        accelerator=setting.accelerator,
        half_gradients=setting.half_gradients,
        world_size=2 if setting.divides else 1,
        measure_error=setting.measure_error,
        tracked=setting.tracked,
    )
    assert modelled == count_job(shapes, rank, setting)
