"""DiLoCo's sparse outer sync (`edgc.sync.outer_sparse`): bit packing of index codes, what one chunk sends
(its top-k, their signs, two magnitudes), the bytes, error-feedback conservation, rollback, exact
resume, the per-tensor density choice (two gloo processes: `test_outer_sync`)."""

import math

import pytest
import torch
from test_baselines import grads_of, reduce

from edgc.sync.outer_alloc import allocate_by_cost
from edgc.sync.outer_sparse import DENSITIES, AllocatedSparseState, SparseQuantState, pack_bits, unpack_bits
from edgc.sync.sync_methods import sync_method

SHAPES = ((64, 96), (96,), (16, 8, 4))


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def errors(state, count):
    return flat([state.error[f"p{i}"] for i in range(count)])


@pytest.mark.parametrize("bits", [1, 5, 12, 13, 21])
def test_pack_bits_round_trips_in_bits_per_code(bits):
    n = 8 * 11 + 3
    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_each_chunk_sends_its_top_k_with_their_signs_and_two_magnitudes():
    state = SparseQuantState(density=8 / 256, chunk=256)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    lay = state.layout(x.numel())
    assert (lay.size, lay.chunks, lay.k, lay.index_bits) == (256, 4, 8, 8)
    sent = state.decode(*state.encode(x, lay), lay)
    padded = torch.cat([x, torch.zeros(lay.chunks * lay.size - x.numel())]).view(lay.chunks, -1)
    for c, row in enumerate(sent.split(lay.size)):
        kept = row.nonzero().squeeze(1)
        assert set(kept.tolist()) == set(padded[c].abs().topk(lay.k).indices.tolist())
        assert torch.equal(torch.sign(row[kept]), torch.sign(padded[c][kept]))
        top = padded[c].abs().topk(lay.k).values
        assert set(row[kept].abs().tolist()) <= {top[:4].mean().item(), top[4:].mean().item()}


def test_sparse_sync_counts_its_bytes_and_conserves():
    grads = grads_of(shapes=SHAPES)
    state = SparseQuantState(density=8 / 256, chunk=256)
    out = reduce(state, grads)
    expected = 0
    for g in grads:  # chunk of min(256, n); k = ⌈density · chunk⌉; ⌈log2 chunk⌉ + 1 bits a code; 2 fp32 a chunk
        size = min(256, g.numel())
        chunks, k = math.ceil(g.numel() / size), math.ceil(8 / 256 * size)
        expected += math.ceil(chunks * k * (math.ceil(math.log2(size)) + 1) / 8) + 4 * chunks * min(2, k)
    assert state.last_step_metrics["bytes_sent"] == expected == state.message_bytes([g.numel() for g in grads])
    residual = errors(state, len(grads))
    assert torch.allclose(flat(out) + residual, flat(grads), atol=1e-6)  # world of one: sent + e = M
    again = reduce(state, [torch.zeros_like(g) for g in grads])  # the next step sends from the residual
    assert torch.allclose(flat(again) + errors(state, len(grads)), residual, atol=1e-6)


def test_registered_sparse_methods_send_at_most_two_hundredths_of_the_raw_bytes():
    n = 4096 * 64
    for name, density in (("sparse64", 64 / 4096), ("sparse128", 128 / 4096), ("sparse64a", 64 / 4096)):
        state = sync_method(name).build(None)
        assert isinstance(state, SparseQuantState) and state.density == density
        assert state.message_bytes([n]) <= 0.02 * 4 * n
    with pytest.raises(ValueError, match="density"):
        SparseQuantState(density=0)
    with pytest.raises(ValueError, match="density"):
        AllocatedSparseState(density=0.5)


def test_a_rolled_back_step_restores_the_error_feedback_and_a_resumed_state_steps_alike():
    state = SparseQuantState(density=8 / 256, chunk=256)
    reduce(state, grads_of(shapes=SHAPES))
    before = {n: e.clone() for n, e in state.error.items()}
    state.defer_commit = True
    reduce(state, grads_of(1, shapes=SHAPES))
    state.rollback_step()
    assert state.step == 1 and all(torch.equal(state.error[n], e) for n, e in before.items())
    state.defer_commit = False
    resumed = SparseQuantState(density=8 / 256, chunk=256)
    resumed.load_state_dict(state.state_dict())
    a, b = reduce(state, grads_of(2, shapes=SHAPES)), reduce(resumed, grads_of(2, shapes=SHAPES))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(state.error[n], resumed.error[n]) for n in state.error)


def test_allocation_by_cost_moves_bytes_to_the_tensor_whose_error_falls_most():
    costs = [[10, 20, 40], [10, 20, 40]]
    quiet = [1.0, 0.5, 0.25]
    loud = [100 * e for e in quiet]
    assert allocate_by_cost([loud, quiet], costs, 55) == [2, 0]
    assert allocate_by_cost([quiet, quiet], costs, 40) == [1, 1]
    assert allocate_by_cost([loud, loud], costs, 20) == [0, 0]  # the cheapest always fits


def test_allocated_sparse_sync_stays_within_its_budget_and_conserves():
    grads = grads_of(shapes=((64, 256), (64, 256)))
    grads[1] *= 50
    state = AllocatedSparseState(density=1 / 64, chunk=256)
    out = reduce(state, grads)
    assert state.last_step_metrics["bytes_sent"] <= state.message_bytes([g.numel() for g in grads])
    assert state.last_density["p1"] > 1 / 64 > state.last_density["p0"]
    assert set(state.last_density.values()) <= set(DENSITIES)
    assert torch.allclose(flat(out) + errors(state, 2), flat(grads), atol=1e-4)


def test_the_codec_decodes_what_it_encoded_and_zeros_from_an_all_zero_message():
    from edgc.sync.outer_sparse import SparseCodec

    codec = SparseCodec(density=8 / 256, chunk=256)
    for n in (1000, 256, 37):
        x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        size = codec.message_bytes(n)
        assert size % 4 == 0 and size <= 0.1 * 4 * n + 16
        out = torch.full((size,), 255, dtype=torch.uint8)
        sent = codec.encode(x, out)
        assert sent.dtype == x.dtype and torch.equal(codec.decode(out, n, x.dtype), sent)
        size_of_chunk = min(256, n)  # k of each chunk sent, the rest zero
        assert torch.count_nonzero(sent) == math.ceil(n / size_of_chunk) * math.ceil(8 / 256 * size_of_chunk)
        assert not codec.decode(torch.zeros(size, dtype=torch.uint8), n).any()


def test_an_outer_sync_spec_is_a_registered_name_and_its_modifiers(monkeypatch):
    import edgc.sync.sync_methods as methods

    assert methods.outer_sync_spec("sparse64-decay0.95-mom0-lr1") == {
        "sync": "sparse64",
        "decay": 0.95,
        "outer_momentum": 0.0,
        "outer_lr": 1.0,
    }
    assert methods.outer_sync_spec("quant3-noef") == {"sync": "quant3", "decay": 0.0}
    known = methods.sync_method
    monkeypatch.setattr(methods, "sync_method", lambda name: known("quant3") if name == "quant3-2s" else known(name))
    assert methods.outer_sync_spec("quant3-2s-lr1") == {"sync": "quant3-2s", "outer_lr": 1.0}  # a name with a dash
    for bad in ("quant9", "sparse64-mom", "sparse64-lr1-lr2", "sparse64-x"):
        with pytest.raises(ValueError):
            methods.outer_sync_spec(bad)


def test_tiles_are_cut_as_the_reference_cuts_a_dimension_and_each_tile_sends_its_own_top_k():
    from edgc.sync.outer_sparse import tile_side, tiling

    assert [tile_side(n, 64) for n in (128, 352, 300, 40, 7, 1)] == [64, 44, 60, 40, 7, 1]
    assert tiling((128, 64), 64) == (4096, None)  # rows of one tile: the flat order already
    assert tiling((300,), 64) == (60, None)
    state = SparseQuantState(density=4 / 64, tile=8, aggregate="senders")
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(5))
    out = reduce(state, [x])[0]  # a world of one: what it sent
    tiles = x.view(2, 8, 3, 8).permute(0, 2, 1, 3).reshape(6, 64)
    sent = out.view(2, 8, 3, 8).permute(0, 2, 1, 3).reshape(6, 64)
    for tile, row in zip(tiles, sent):
        assert set(row.nonzero().squeeze(1).tolist()) == set(tile.abs().topk(4).indices.tolist())
    assert torch.allclose(out + state.error["p0"], x, atol=1e-6)  # sent + e = M, in the tensor's own order
    assert state.last_step_metrics["bytes_sent"] == state.message_bytes([(16, 24)])
    for bad in (dict(aggregate="median"), dict(tile=1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SparseQuantState(**bad)


def _senders_worker(rank, world_size, name):
    torch.manual_seed(200 + rank)
    grads = [torch.randn(40, 300), torch.randn(300)]
    state = sync_method(name).build(None)
    out = reduce(state, [g.clone() for g in grads])
    return {"sent": [g - state.error[f"p{i}"] for i, g in enumerate(grads)], "out": out}


@pytest.mark.parametrize("name", ["sparse128-senders", "sparse128-tiles"])
def test_a_value_is_averaged_over_the_replicas_that_sent_it(name):
    from distributed_harness import run_distributed

    a, b = run_distributed(_senders_worker, 2, name)
    counts = []
    for i in range(2):
        assert torch.equal(a["out"][i], b["out"][i])
        senders = (a["sent"][i] != 0).float() + (b["sent"][i] != 0).float()
        expected = (a["sent"][i] + b["sent"][i]) / senders.clamp(min=1)
        assert torch.allclose(a["out"][i], expected, atol=1e-5)
        counts.append(senders.reshape(-1))
    assert set(torch.cat(counts).unique().tolist()) == {0, 1, 2}  # values one replica sent, and both
