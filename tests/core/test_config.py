import dataclasses
import re

import pytest

from edgc import EDGCConfig, LowRankConfig, field_docs
from edgc.config import nested_config_dict

INVALID = [
    ("r_max", 0),
    ("r_max", -3),
    ("r_max", 2.5),
    ("r_min", 0),
    ("rank_step", 0),
    ("window", 0),
    ("iteration_sample_ratio", 0.0),
    ("iteration_sample_ratio", 1.5),
    ("iteration_sample_ratio", float("nan")),
    ("gradient_sample_ratio", 0.0),
    ("gradient_sample_ratio", -0.1),
    ("gradient_sample_ratio", 2),
    ("entropy_bins", 1),
    ("warmup_fraction", -0.1),
    ("warmup_fraction", 1.01),
    ("total_steps", 0),
    ("cqm_exponent", 0),
    ("rank_mapping", "linear"),
    ("entropy_estimator", "kde"),
    ("profile_max_rank", 1),
    ("profile_steps_per_rank", 0),
    ("rank_granularity", 0),
    ("min_warmup_steps", -1),
    ("adaptive", "yes"),
    ("cqm_mc_samples", 0),
    ("window", True),
]
INVALID_ENGINE = [
    ("min_compression_rate", -1),
    ("communication_dtype", "int8"),
    ("seed", -1),
    ("orthogonalization_epsilon", float("inf")),
]


@pytest.mark.parametrize("name,value", INVALID)
def test_invalid_value_names_the_field(name, value):
    kwargs = {name: value}
    if name == "r_min":
        kwargs["r_max"] = 8
    with pytest.raises(ValueError, match=rf"EDGCConfig\.{name}\b"):
        EDGCConfig(**kwargs)


@pytest.mark.parametrize("name,value", INVALID_ENGINE)
def test_invalid_engine_value_names_the_field(name, value):
    with pytest.raises(ValueError, match=rf"LowRankConfig\.{name}\b"):
        EDGCConfig(engine=LowRankConfig(**{name: value}))


def test_r_min_above_r_max_is_rejected():
    with pytest.raises(ValueError, match=r"EDGCConfig\.r_min .*≤ r_max"):
        EDGCConfig(r_max=8, r_min=16)


def test_r_min_without_r_max_is_rejected():
    with pytest.raises(ValueError, match=r"EDGCConfig\.r_min"):
        EDGCConfig(r_min=4)


def test_defaults_are_the_papers():
    config = EDGCConfig()
    assert (config.iteration_sample_ratio, config.gradient_sample_ratio) == (0.1, 0.25)
    assert (config.window, config.rank_step, config.entropy_bins, config.engine.seed) == (1000, 4, 1000, 714)
    assert config.sample_every == 10 and config.element_stride == 4


def test_warmup_floor():
    assert EDGCConfig(total_steps=1000, warmup_fraction=0.1).warmup_floor() == 100
    assert EDGCConfig(warmup_fraction=0.1).warmup_floor() == 2  # no planned length: only the absolute floor


def test_static_is_non_adaptive_fixed_rank():
    config = EDGCConfig.static(rank=8, total_steps=100)
    assert (config.r_min, config.r_max, config.adaptive, config.warmup_error_test) == (8, 8, False, False)


def test_every_field_is_documented_with_a_default():
    docs = field_docs()
    assert [name for name, _, _ in docs] == [f.name for f in dataclasses.fields(EDGCConfig)]
    assert all(doc.strip() for _, _, doc in docs)


def test_dict_round_trip_and_unknown_field():
    config = EDGCConfig(r_max=16, window=50)
    assert EDGCConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown field"):
        EDGCConfig.from_dict({"rmax": 3})


def test_a_config_dict_saved_with_the_engine_fields_flat_still_loads():
    config = EDGCConfig(r_max=16, window=50, engine=LowRankConfig(seed=3, error_feedback=False))
    nested = config.to_dict()
    flat = {**{k: v for k, v in nested.items() if k != "engine"}, **nested["engine"]}  # what earlier versions wrote
    assert nested_config_dict(flat) == nested and nested_config_dict(nested) == nested
    assert EDGCConfig.from_dict(nested_config_dict(flat)) == config
    given_flat = "EDGCConfig has no field 'seed': it is an engine field, EDGCConfig(engine=LowRankConfig(seed=...))"
    with pytest.raises(ValueError, match=re.escape(given_flat)):
        EDGCConfig.from_dict({"r_max": 16, "seed": 3})
    with pytest.raises(ValueError, match=re.escape("unknown field(s) ['engine.sed']")):
        EDGCConfig.from_dict({"engine": {"sed": 3}})


def test_static_rejects_conflicting_overrides():
    with pytest.raises(ValueError, match=r"EDGCConfig\.static.*r_max"):
        EDGCConfig.static(rank=8, r_max=16)
