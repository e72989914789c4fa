"""The checks of a `TrainConfig` (config.py) when it is built: each field's type and range, then the
combinations of parallelisms and compressors, then the model's shape. The first problem found is
raised as a ValueError that names the field, in the order below."""

from __future__ import annotations

import math
from typing import Any

# The harness's own ways to sync (DDP's native all-reduce, our hook uncompressed or after backward,
# no sync, our engine, PyTorch's PowerSGD hook); the rest come from the library's registry.
OWN_COMPRESSORS = ("none", "allreduce", "allreduce-blocking", "nosync", "powersgd", "torch-powersgd", "edgc")
FSDP_COMPRESSORS = ("none", "allreduce", "powersgd", "edgc")  # none: native HSDP; the others via the hook
MOE_COMPRESSORS = ("allreduce", "powersgd", "edgc")  # both groups synced after backward by our states
PIPELINE_COMPRESSORS = ("none", "powersgd", "edgc", "optimus-cc")  # those a pipeline stage can use
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
INTERSTAGE_MODES = ("off", "all", "cooldown")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")


def compressor_names() -> tuple[str, ...]:
    """Every ``--compressor``: the harness's own, the library's registered sync methods, optimus-cc."""
    from edgc.sync.sync_methods import sync_method_names

    return (*OWN_COMPRESSORS, *sync_method_names(), "optimus-cc")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class FieldChecks:
    """The checks of one config's fields, each raising with the field's name and value."""

    def __init__(self, config) -> None:
        self.config = config

    def fail(self, name: str, requirement: str) -> None:
        raise ValueError(f"{name}: {requirement}, got {getattr(self.config, name)!r}")

    def integer(self, name: str, low: int, high: int | None = None, optional: bool = False) -> None:
        v = getattr(self.config, name)
        if optional and v is None:
            return
        if not is_int(v) or v < low or (high is not None and v > high):
            self.fail(
                name, f"must be an integer in [{low}, {high}]" if high is not None else f"must be an integer ≥ {low}"
            )

    def number(self, name: str, low: float, high: float, low_open: bool = False, high_open: bool = False) -> None:
        v = getattr(self.config, name)
        ok = is_num(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
        if not ok:
            self.fail(name, f"must be a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")

    def choice(self, name: str, choices: tuple) -> None:
        if getattr(self.config, name) not in choices:
            self.fail(name, f"must be one of {', '.join(choices)}")


def check_fields(c) -> None:
    """Every check of config ``c``, in order."""
    check = FieldChecks(c)
    check_data_and_model(c, check)
    check_optimization(c, check)
    check_pipeline(c, check)
    check_fsdp_and_moe(c, check)
    check_runtime(c, check)
    check_model_shape(c, check)


def check_data_and_model(c, check: FieldChecks) -> None:
    if c.data is not None and (not isinstance(c.data, str) or not c.data):
        check.fail("data", "must be a path")
    check.integer("max_chars", 1000, optional=True)
    check.integer("vocab_size", 257, 1_000_000)
    check.number("val_fraction", 0, 0.5, low_open=True)
    from .model import PRESETS

    check.choice("preset", tuple(PRESETS))
    for name in ("n_layer", "n_embd", "n_head"):
        check.integer(name, 1, optional=True)
    check.number("dropout", 0, 1, high_open=True)
    check.integer("seq_len", 2)


def check_optimization(c, check: FieldChecks) -> None:
    check.integer("micro_batch", 1)
    check.integer("grad_accum", 1)
    check.integer("steps", 1)
    check.number("lr", 0, 10, low_open=True)
    check.number("min_lr_ratio", 0, 1)
    check.integer("warmup_steps", 0, c.steps if is_int(c.steps) else None, optional=True)
    check.number("weight_decay", 0, math.inf, high_open=True)
    check.number("beta1", 0, 1, high_open=True)
    check.number("beta2", 0, 1, high_open=True)
    check.number("grad_clip", 0, math.inf, high_open=True)
    check.integer("seed", 0, 2**32 - 1)
    if c.compressor not in (*OWN_COMPRESSORS, "optimus-cc"):
        check.choice("compressor", compressor_names())  # (the registry imports torch: only here)


def check_pipeline(c, check: FieldChecks) -> None:
    """--pp, --tp, their schedule, the inter-stage compression and the compressors a stage can run."""
    check.integer("pp", 1)
    check.integer("tp", 1)
    if c.tp > 1 and c.compressor not in PIPELINE_COMPRESSORS:
        check.fail("compressor", f"with --tp > 1 must be one of {', '.join(PIPELINE_COMPRESSORS)}")
    if c.tp > 1 and c.pp == 1 and c.eval_batches % c.grad_accum:
        check.fail("eval_batches", f"must be a multiple of grad_accum = {c.grad_accum} with --tp (whole steps)")
    check.choice("pp_schedule", PIPELINE_SCHEDULES)
    check.integer("selective_stages", 1, c.pp if is_int(c.pp) else None)
    check.choice("interstage", INTERSTAGE_MODES)
    check.integer("interstage_rank", 1)
    check.integer("interstage_min_rank", 1, c.interstage_rank if is_int(c.interstage_rank) else None)
    if c.interstage != "off" and c.pp == 1:
        check.fail("interstage", "compresses pipeline traffic and needs --pp > 1")
    if c.pp > 1 and c.compressor not in PIPELINE_COMPRESSORS:
        check.fail("compressor", f"with --pp > 1 must be one of {', '.join(PIPELINE_COMPRESSORS)}")
    if c.pp == 1 and c.compressor == "optimus-cc":
        check.fail("compressor", "optimus-cc (selective stage compression) needs --pp > 1")
    if c.pp > 1 and c.grad_accum < c.pp:
        check.fail("grad_accum", f"is the number of pipeline micro-batches and must be ≥ pp = {c.pp}")
    if c.pp > 1 and c.eval_batches % c.grad_accum:
        check.fail(
            "eval_batches", f"must be a multiple of grad_accum = {c.grad_accum} with --pp (whole pipeline steps)"
        )


def check_fsdp_and_moe(c, check: FieldChecks) -> None:
    check.integer("fsdp_shard", 0)
    if c.fsdp and c.pp > 1:
        check.fail("fsdp", "cannot be combined with --pp > 1")
    if c.fsdp and c.compressor not in FSDP_COMPRESSORS:
        check.fail("compressor", f"with --fsdp must be one of {', '.join(FSDP_COMPRESSORS)}")
    check.integer("moe_experts", 0)
    check.integer("ep", 1)
    check.number("moe_aux_weight", 0, math.inf, high_open=True)
    if not c.moe_experts:
        if c.ep > 1:
            check.fail("ep", "needs --moe-experts (expert parallelism splits experts)")
        return
    check.integer("moe_top_k", 1, c.moe_experts)
    if c.moe_experts % c.ep:
        check.fail("ep", f"must divide --moe-experts {c.moe_experts}")
    if c.compressor not in MOE_COMPRESSORS:
        check.fail("compressor", f"with --moe-experts must be one of {', '.join(MOE_COMPRESSORS)}")
    if c.fsdp or c.pp > 1 or c.tp > 1:
        check.fail("moe_experts", "runs data and expert parallel only (not with --fsdp, --pp or --tp)")


def check_runtime(c, check: FieldChecks) -> None:
    """The compressors' own settings, evaluation, checkpoints, switches, device and backend."""
    check.integer("powersgd_rank", 1)
    check.number("compress_ratio", 0, 1, low_open=True)
    check.integer("eval_every", 0)
    check.integer("eval_batches", 1)
    check.integer("ckpt_every", -1)
    for name in ("fsdp", "tensorboard", "comm_trace", "progress", "deterministic"):
        if not isinstance(getattr(c, name), bool):
            check.fail(name, "must be true or false")
    check.choice("device", DEVICES)
    check.choice("backend", BACKENDS)
    if not isinstance(c.edgc, dict):
        check.fail("edgc", "must be a table of EDGCConfig fields")


def check_model_shape(c, check: FieldChecks) -> None:
    """Shape problems (n_embd % n_head, n_positions < seq_len) now, not after data preparation."""
    from .model import model_shape

    shape = model_shape(c.preset, c.vocab_size, c.seq_len, c.n_layer, c.n_embd, c.n_head)
    if c.tp > 1 and (shape["n_head"] % c.tp or shape["n_embd"] % c.tp):
        check.fail("tp", f"must divide the model's {shape['n_head']} heads and width {shape['n_embd']}")
    if c.pp > shape["n_layer"]:
        check.fail("pp", f"must be ≤ the model's {shape['n_layer']} transformer blocks (one stage needs one)")
    if c.edgc and not c.uses_edgc_config:
        check.fail("edgc", f"EDGC fields only apply to compressors edgc, powersgd and optimus-cc, not {c.compressor}")
