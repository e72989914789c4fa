"""What one DiLoCo outer step of the two-stage sync allocates (`edgc_bench.outer_memory`), counted as the
engine's memory is (the tensors made during the step alive at once): the pseudo-gradient Δ and a
transient set by the bucket and the largest parameter tensor, the same at twice the model."""

import torch

from edgc.integrations.diloco import DiLoCo
from edgc_bench.outer_memory import _model, step_memory

BUCKET = 2**16


def live_bytes(log2: int, method: str) -> float:
    module = _model(log2)
    inner = torch.optim.SGD(module.parameters(), lr=1e-3)
    outer = torch.optim.SGD(module.parameters(), lr=0.7, momentum=0.5, nesterov=True)
    diloco = DiLoCo(None, [module], inner, outer, 1, sync_method=method)
    diloco.state.bucket_values = BUCKET
    _, live, committed = step_memory(diloco, inner)
    assert committed
    return live


def test_an_outer_step_holds_delta_and_a_bucket_whatever_the_model():
    small, large = live_bytes(20, "quant3-2s"), live_bytes(21, "quant3-2s")
    delta_small, delta_large = 4 * 2**20, 4 * 2**21
    assert delta_small <= small and delta_large <= large
    assert large - delta_large == small - delta_small  # the transient beyond Δ: the bucket's, not the model's
    # the outer Nesterov step's temporary of one parameter tensor (2^20 values) and a few buffers of one bucket
    assert small - delta_small < 4 * 2**20 + 40 * BUCKET
