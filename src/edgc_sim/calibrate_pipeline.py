"""Calibration of the inter-stage model against a TP × PP `edgc bench` (`edgc bench --tp T --pp P`).

Each emulated host runs one whole TP × PP model, so the pipeline's point-to-point traffic stays on
the host (local gloo) while the DP groups cross the rate-limited link. Per run and per group of steps
with the same inter-stage ranks (rank 0's metrics.jsonl, replica 0, TP rank 0; the first
SKIP_FRACTION of the run left out), the simulator predicts:

* inter-stage bytes (sent, raw) per step — `edgc_sim.interstage_model.step_bytes`, i.e. `edgc.parallel.interstage`'s
  wire format and cool-down policy; these must equal the logged ones exactly;
* the schedule: `cost_model.one_f_one_b_timeline` with each stage's *measured* forward and backward
  compute per micro-batch (median forward_s / backward_s over the group ÷ micro-batches: TP
  all-reduces included, they run inside the blocks), activations forward raw and activation
  gradients back at their wire size over the local link (alpha + bytes / beta of the host profile's
  gloo fit), and each compressed gradient's compress + decompress (the PowerSGD cost model on the
  host profile) on its sender's backward;
* inter-stage time = what `edgc train` times (`edgc_train.stage_link.StageLink.spans`) summed over the stages:
  the receivers' idle time before each backward in the timeline (waiting for the next stage's
  gradient, its transfer included; `cost_model.backward_waits`) + the senders' compress time;
* with --interstage on, its parts that the compressed sizes set, against what `edgc train` logs of
  them: the payload transfers (interstage_wire_s: from a gradient's header arriving to its payload
  arriving; predicted alpha + payload bytes / beta each) and compress + decompress
  (interstage_compress_s; predicted by the compress model);
* step time = the predicted schedule + the group's measured remainder of the step (step_time_s minus
  the longest stage's pipeline_s: DP sync, tied-embedding sum, clipping, optimizer), which this
  model does not predict; so the step error is the schedule's error in seconds over the step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edgc.parallel.interstage import HEADER_BYTES

from . import cost_model as cm
from .calibrate import SKIP_FRACTION, MeasuredRun, harness_model
from .hardware import DeviceSpec, LinkSpec
from .interstage_model import compress_s, gradient_bytes, gradient_ranks, step_bytes, transfer_s

BYTES = 4  # fp32 activations and gradients (edgc train on CPU)


@dataclass(frozen=True)
class PipelineRow:
    """Predicted vs measured for one (run, inter-stage ranks) group of steps."""

    run: str  #: run folder name
    compressor: str  #: config["compressor"] (the DP sync)
    mode: str  #: config["interstage"]: off | all | cooldown
    ranks: tuple  #: per stage, the inter-stage rank it sent at (None: raw; stage 0 sends nothing)
    steps: int  #: steps in the group
    bytes_measured: float  #: median interstage_bytes_sent per step
    bytes_predicted: int  #: step_bytes, sent
    raw_measured: float  #: median interstage_bytes_raw per step
    raw_predicted: int  #: step_bytes, raw
    interstage_measured_s: float  #: median interstage_time_s (summed over stages)
    interstage_predicted_s: float  #: timeline waits + compress, summed over stages
    wire_measured_s: float | None  #: median interstage_wire_s summed over stages; None with off (not separable)
    wire_predicted_s: float | None  #: the compressed path's payload transfers (alpha + bytes / beta each)
    compress_measured_s: float | None  #: median interstage_compress_s summed over stages (None with off)
    compress_predicted_s: float  #: the compress model over the compressed gradients
    pipeline_measured_s: float  #: median over steps of the longest stage's pipeline_s
    pipeline_predicted_s: float  #: the timeline's last backward end
    step_measured_s: float  #: median step_time_s
    step_predicted_s: float  #: pipeline predicted + the measured remainder

    @property
    def bytes_exact(self) -> bool:
        return self.bytes_measured == self.bytes_predicted and self.raw_measured == self.raw_predicted

    @property
    def interstage_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.interstage_predicted_s - self.interstage_measured_s) / self.interstage_measured_s

    @property
    def wire_error(self) -> float | None:
        return _error(self.wire_predicted_s, self.wire_measured_s)

    @property
    def compress_error(self) -> float | None:
        return _error(self.compress_predicted_s, self.compress_measured_s)

    @property
    def step_error(self) -> float:
        return (self.step_predicted_s - self.step_measured_s) / self.step_measured_s


def _error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def is_pipeline_run(run: MeasuredRun) -> bool:
    return int(run.config.get("pp") or 1) > 1


def _groups(run: MeasuredRun) -> list:
    """(per-stage inter-stage ranks, records) after the first SKIP_FRACTION of the run."""
    records = run.records[int(len(run.records) * SKIP_FRACTION) :] or run.records
    groups: dict = {}
    for rec in records:
        ranks = tuple(s.get("interstage_rank") for s in rec["stages"])
        groups.setdefault(ranks, []).append(rec)
    return sorted(groups.items(), key=lambda kv: tuple(-1 if r is None else r for r in kv[0]))


def predict_schedule(
    t_fwd: Sequence[float],
    t_bwd: Sequence[float],
    micro_batches: int,
    mode: str,
    ranks: Sequence[int | None],
    rows: int,
    cols: int,
    link: cm.AlphaBeta,
    device: DeviceSpec,
) -> tuple:
    """(timeline, per-stage inter-stage seconds, payload transfer seconds, compress seconds) of one step:
    t_fwd/t_bwd per stage (compute of one micro-batch), ranks[s] the rank stage s sends its gradients
    at. The last two are the parts the compressed sizes set, summed over the step's gradients: each
    payload's transfer without its header (what interstage_wire_s times; None with ``off``, which
    has no header to time it from) and compress + decompress; the rest is waiting for compute."""
    P = len(t_fwd)
    forward = [transfer_s(rows * cols * BYTES, link)] * (P - 1)
    per_stage = [gradient_ranks(mode, ranks[s], micro_batches, P, rows, cols) for s in range(P)]
    compress = [
        [
            compress_s(
                r,
                rows,
                cols,
                device.flops_per_s("fp32"),
                device.mem_bytes_per_s,
                device.launch_s,
                BYTES,
                device.skinny_rates(),
            )
            if s > 0
            else 0.0
            for r in per_stage[s]
        ]
        for s in range(P)
    ]
    backward = [
        [transfer_s(gradient_bytes(r, rows, cols, BYTES), link) for r in per_stage[s + 1]] for s in range(P - 1)
    ]
    t_bwd_micro = [[t_bwd[s] + c for c in compress[s]] for s in range(P)]
    timeline = cm.one_f_one_b_timeline(t_fwd, t_bwd_micro, micro_batches, forward, backward)
    waits = cm.backward_waits(timeline, P, micro_batches)
    payload = (
        None
        if mode == "off"
        else sum(
            transfer_s(gradient_bytes(r, rows, cols, BYTES) - HEADER_BYTES, link)
            for s in range(1, P)
            for r in per_stage[s]
        )
    )
    return timeline, [w + sum(c) for w, c in zip(waits, compress)], payload, sum(map(sum, compress))


def calibrate_pipeline(runs: Sequence[MeasuredRun], device: DeviceSpec, link: LinkSpec) -> list:
    """One PipelineRow per (run, inter-stage ranks); `link`: the local (intra-host) gloo fit."""
    local = cm.AlphaBeta(link.latency_s, link.bytes_per_s)
    rows = []
    for run in runs:
        if not is_pipeline_run(run):
            raise ValueError(
                f"{run.path}: not a pipeline run (config pp = {run.config.get('pp')}); "
                "calibrate TP x PP bench runs on their own"
            )
        cfg = run.config
        P, m = int(cfg["pp"]), int(cfg["grad_accum"])
        mode = str(cfg.get("interstage") or "off")
        tokens, hidden = int(cfg["micro_batch"]) * int(cfg["seq_len"]), harness_model(cfg).hidden
        for ranks, recs in _groups(run):
            med = lambda f: statistics.median(f(r) for r in recs)  # noqa: E731

            def measured(key: str) -> float | None:
                """Median over steps of the stages' sum; None where not logged (off, or older runs)."""
                if mode == "off" or any(key not in s for r in recs for s in r["stages"]):
                    return None
                return med(lambda r: sum(s[key] for s in r["stages"]))

            t_fwd = [med(lambda r: r["stages"][s]["forward_s"]) / m for s in range(P)]
            t_bwd = [med(lambda r: r["stages"][s]["backward_s"]) / m for s in range(P)]
            timeline, interstage, wire, compress = predict_schedule(
                t_fwd, t_bwd, m, mode, ranks, tokens, hidden, local, device
            )
            sent, raw = step_bytes(mode, list(ranks), m, P, tokens, hidden, BYTES)
            pipeline_meas = med(lambda r: max(s["pipeline_s"] for s in r["stages"]))
            pipeline_pred = max(timeline.flush_end)
            remainder = med(lambda r: r["step_time_s"] - max(s["pipeline_s"] for s in r["stages"]))
            rows.append(
                PipelineRow(
                    Path(run.path).name,
                    str(cfg["compressor"]),
                    mode,
                    ranks,
                    len(recs),
                    med(lambda r: r["interstage_bytes_sent"]),
                    sent,
                    med(lambda r: r["interstage_bytes_raw"]),
                    raw,
                    med(lambda r: r["interstage_time_s"]),
                    sum(interstage),
                    measured("interstage_wire_s"),
                    wire,
                    measured("interstage_compress_s"),
                    compress,
                    pipeline_meas,
                    pipeline_pred,
                    med(lambda r: r["step_time_s"]),
                    pipeline_pred + remainder,
                )
            )
    return rows


def format_pipeline_calibration(rows: Sequence[PipelineRow], link: LinkSpec, device: DeviceSpec) -> str:
    """Markdown: the model's inputs, one line per (run, ranks), times in ms, errors in %."""
    ms = lambda s: f"{1e3 * s:.0f}"  # noqa: E731
    pct = lambda e: f"{100 * e:+.1f}%"  # noqa: E731
    opt = lambda s: "-" if s is None else f"{1e3 * s:.2f}"  # noqa: E731
    opt_pct = lambda e: "-" if e is None else pct(e)  # noqa: E731
    lines = [
        f"local link (inter-stage): alpha {link.latency_s * 1e6:.1f} us, beta {link.bytes_per_s / 1e9:.2f} GB/s "
        f"({link.source}); host: {device.flops_per_s('fp32') / 1e9:.1f} GFLOP/s, "
        f"{device.mem_bytes_per_s / 1e9:.1f} GB/s, {device.launch_s * 1e6:.1f} us/op ({device.source})",
        "",
        "| run | inter-stage | ranks per stage | steps | bytes sent meas | bytes sent pred | raw meas | raw pred "
        "| exact | inter-stage meas | inter-stage pred | inter-stage err | wire meas | wire pred | wire err "
        "| compress meas | compress pred | compress err | schedule meas | schedule pred | step meas | step pred "
        "| step err |",
        "|" + "---|" * 23,
    ]
    for r in rows:
        lines.append(
            f"| {r.run} | {r.mode} | {'/'.join('-' if k is None else str(k) for k in r.ranks)} | {r.steps} "
            f"| {r.bytes_measured:.0f} | {r.bytes_predicted} | {r.raw_measured:.0f} | {r.raw_predicted} "
            f"| {'yes' if r.bytes_exact else 'NO'} | {ms(r.interstage_measured_s)} | {ms(r.interstage_predicted_s)} "
            f"| {pct(r.interstage_error)} | {opt(r.wire_measured_s)} | {opt(r.wire_predicted_s)} | "
            f"{opt_pct(r.wire_error)} "
            f"| {opt(r.compress_measured_s)} | {opt(r.compress_predicted_s)} | {opt_pct(r.compress_error)} | "
            f"{ms(r.pipeline_measured_s)} | {ms(r.pipeline_predicted_s)} "
            f"| {ms(r.step_measured_s)} | {ms(r.step_predicted_s)} | {pct(r.step_error)} |"
        )
    lines += [
        "",
        "bytes per step of replica 0's activation gradients (TP rank 0), medians over the group's steps "
        "after the first 10%; times in ms, medians. ranks per stage: the inter-stage rank each stage sent "
        "at (- raw; stage 0 sends nothing). inter-stage: summed over the stages, the time in each "
        "activation-gradient exchange (pred: the 1F1B timeline's idle time before each backward, from the "
        "stages' measured forward/backward compute and the wire sizes over the local link, + the "
        "compress model). wire (ms, 2 decimals): the payload transfers of the compressed path, each from "
        "its header's arrival to its payload's (pred: alpha + payload bytes / beta; - with off, where "
        "no header separates waiting from transfer); compress: compress + decompress (pred: the "
        "PowerSGD compute model of one gradient matrix at its rank). Both summed over the step's "
        "gradients: the part of the inter-stage time the compressed sizes set, the rest is waiting. schedule: the "
        "longest stage's pipeline time. step pred = schedule pred + the "
        "measured rest of the step (DP sync, optimizer: not modelled here).",
    ]
    return "\n".join(lines)
