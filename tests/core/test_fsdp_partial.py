"""Which parameters a partial FSDP reduce-scatter holds (`edgc.parallel.fsdp.partial_layout`): FSDP reduces the
parameters of a group that got gradients in a backward, in the group's order, so a buffer's size names them
when exactly one ordered subset of the group's padded shard sizes adds up to it; otherwise it is refused."""

import pytest

from edgc.parallel.fsdp import partial_layout

# torchtitan's fully_shard([norm, lm_head]) on 2 shards: its chunked loss reduces lm_head in a backward of its own
GROUP = [("norm.weight", (128,), 128), ("lm_head.weight", (1024, 256), 262144)]


def test_each_part_of_a_grouped_module_is_found_by_its_size():
    assert partial_layout(GROUP, 262144) == [GROUP[1]]
    assert partial_layout(GROUP, 128) == [GROUP[0]]
    assert partial_layout(GROUP, 262272) == GROUP


def test_a_size_no_subset_makes_is_refused_in_one_line():
    with pytest.raises(RuntimeError, match="no subset"):
        partial_layout(GROUP, 1000)


def test_two_parameters_of_one_size_are_ambiguous_and_refused():
    twins = [("a", (4, 4), 16), ("b", (4, 4), 16), ("c", (8,), 8)]
    assert partial_layout(twins, 40) == twins
    with pytest.raises(RuntimeError, match="more than one"):
        partial_layout(twins, 24)  # a + c or b + c
