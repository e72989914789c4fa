"""The capture checker (`edgc_probes.capture_check`): each kind of violation planted in a small step of
two regions (P = M·Q, a collective outside, Q = Mᵀ·P, as the engine's stretches go) is caught once,
with its kind, its region and the line to change; the clean step passes, on real and on fake tensors."""

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from edgc.device import streams
from edgc.device.graphs import GraphRegion
from edgc_probes.capture_check import CaptureChecker, check_capture
from edgc_probes.capture_check_judge import (
    ARGUMENTS,
    CHANGED_BUFFER,
    COLLECTIVE,
    DATA_DEPENDENT,
    FRESH_BUFFER,
    HOST_SYNC,
    NEW_REGION,
    OP_SEQUENCE,
    UNDECLARED,
    WAIT,
)
from edgc_probes.stand_ins import counting_communicator

HERE = str(Path(__file__).parent)  # the code under check: this file's
CPU = torch.device("cpu")


class TwoRegions:
    """P = M·Q in region form_p, P sent outside, Q = Mᵀ·P in region form_q, over buffers kept from step to
    step; ``plant`` breaks one rule."""

    def __init__(self, plant: str | None = None):
        self.plant, self.calls = plant, 0
        self.m, self.q = torch.randn(3, 8, 6, device=CPU), torch.randn(3, 6, 2, device=CPU)
        self.p, self.scale = torch.empty(3, 8, 2, device=CPU), torch.ones(1, device=CPU)
        self.form_p, self.form_q = GraphRegion("form_p", graphs=True), GraphRegion("form_q", graphs=True)
        self.comm = counting_communicator(2)

    def step(self) -> None:
        self.calls += 1
        if self.plant == "new region":
            self.form_p = GraphRegion("form_p", graphs=True)
        self.form_p(self._form_p, self.m, self.q, self.p, self.scale)
        self.comm.mean_async(self.p).wait()
        scratch = torch.empty(3, 8, 2, device=CPU) if self.plant == "changed buffer" else self.p
        self.form_q(lambda: self._form_q(scratch), self.m, scratch, self.q)

    def _form_p(self) -> None:
        plant = self.plant
        torch.bmm(self.m, self.q, out=self.p)
        self.p.mul_(0.5 if plant == "changed scalar" and self.calls % 2 else 1.0)
        if plant == "other operators" and self.calls % 2:
            self.p.neg_()
        if plant == "host read":
            self.p.sum().item()
        if plant == "data-dependent size":
            torch.nonzero(self.p)
        if plant == "undeclared":
            self.p.add_(torch.ones_like(self.p) * self.m.sum())  # fine: scratch
            self.p.mul_(self.unlisted)
        if plant == "collective":
            self.comm.mean_async(self.p)
        if plant == "wait":
            streams.current_stream(CPU).wait_stream(self.side)

    def _form_q(self, p: torch.Tensor) -> None:
        if self.plant == "fresh buffer":
            self.q = torch.bmm(self.m.transpose(1, 2), p)  # made in the region, kept for the next step
        else:
            torch.bmm(self.m.transpose(1, 2), p, out=self.q)


def checked(plant: str | None, steps: int = 2) -> list:
    model = TwoRegions(plant)
    model.unlisted, model.side = torch.full((1,), 2.0, device=CPU), streams.new_stream(CPU)
    return check_capture(model.step, steps, settle=1, library=HERE)


def test_a_step_that_keeps_its_buffers_and_its_work_passes():
    assert checked(None, steps=3) == []


@pytest.mark.parametrize(
    "plant, kind, region, line",
    [
        ("fresh buffer", FRESH_BUFFER, "form_q", "self.q = torch.bmm(self.m.transpose(1, 2), p)"),
        ("changed buffer", CHANGED_BUFFER, "form_q", "scratch = torch.empty(3, 8, 2, device=CPU)"),
        ("host read", HOST_SYNC, "form_p", "self.p.sum().item()"),
        ("changed scalar", ARGUMENTS, "form_p", "self.p.mul_(0.5 if plant"),
        ("data-dependent size", DATA_DEPENDENT, "form_p", "torch.nonzero(self.p)"),
        ("other operators", OP_SEQUENCE, "form_p", "self.p.neg_()"),
        ("undeclared", UNDECLARED, "form_p", "self.p.mul_(self.unlisted)"),
        ("collective", COLLECTIVE, "form_p", "self.comm.mean_async(self.p)"),
        ("wait", WAIT, "form_p", "streams.current_stream(CPU).wait_stream(self.side)"),
        ("new region", NEW_REGION, "form_p", None),
    ],
)
def test_each_planted_violation_is_caught_once_where_it_is(plant, kind, region, line):
    (violation,) = checked(plant)
    assert (violation.kind, violation.region) == (kind, region), str(violation)
    assert "test_capture_check.py:" in violation.site
    if line is not None:  # the site names the line to change
        number = int(violation.site.split(":")[1].split()[0])
        assert line in Path(__file__).read_text().splitlines()[number - 1], str(violation)


class Stretches:
    """No region: the library's work between a collective and a wait (today's engine's stretches)."""

    def __init__(self, fresh: bool):
        self.fresh = fresh
        self.m, self.q, self.p = torch.randn(8, 6), torch.randn(6, 2), torch.empty(8, 2)
        self.comm = counting_communicator(2)

    def step(self) -> None:
        p = torch.mm(self.m, self.q) if self.fresh else torch.mm(self.m, self.q, out=self.p)
        self.comm.mean_async(p).wait()
        torch.mm(self.m.t(), p, out=self.q)


@pytest.mark.parametrize("fresh", [False, True])
def test_without_regions_the_stretches_between_collectives_are_checked(fresh):
    violations = check_capture(Stretches(fresh).step, library=HERE)
    assert [v.kind for v in violations] == ([FRESH_BUFFER] if fresh else []), violations
    if fresh:
        assert "torch.mm(self.m, self.q) if self.fresh" in violations[0].detail
        assert "a collective" in violations[0].detail


@pytest.mark.parametrize("plant", [None, "fresh buffer", "host read"])
def test_fake_tensors_are_checked_as_device_tensors(plant):
    with FakeTensorMode():
        violations = checked(plant)
    assert [v.kind for v in violations] == {None: [], "fresh buffer": [FRESH_BUFFER], "host read": [HOST_SYNC]}[
        plant
    ], violations


def test_the_step_reads_allowed_outside_regions_pass_and_others_are_counted():
    from edgc.device.timing import host_reads_allowed

    x = torch.ones(4, device=CPU)
    with CaptureChecker(library=HERE) as checker:
        for _ in range(2):
            with checker.step():
                with host_reads_allowed():
                    x.sum().item()
                x.sum().item()
    (violation,) = checker.violations()
    assert violation.kind == HOST_SYNC and violation.region == "the step"


class InTurn:
    """Q in two halves of one buffer used in turn (the warm start's and the rollback's): by one region
    that alternates between them, or by a region per half."""

    def __init__(self, per_half: bool):
        self.m, self.q = torch.randn(8, 6, device=CPU), torch.randn(2, 6, 2, device=CPU)
        self.regions = [GraphRegion("form_q", graphs=True) for _ in range(2 if per_half else 1)]
        self.calls = 0

    def step(self) -> None:
        old, new = self.calls % 2, 1 - self.calls % 2
        region = self.regions[old % len(self.regions)]
        region(lambda: torch.mm(self.m.t(), torch.mm(self.m, self.q[old]), out=self.q[new]), self.m, self.q)
        self.calls += 1


def test_buffers_used_in_turn_need_a_region_per_buffer_and_that_period():
    """A replay repeats its capture: one region alternating between halves would always use the captured
    half (each call is compared with the region's call before, whatever the period); a region per half
    holds, checked at period 2 over 4 steps (at period 1 the region at each place changes every step)."""
    alternating = check_capture(InTurn(per_half=False).step, 4, period=2, library=HERE)
    assert {v.kind for v in alternating} == {ARGUMENTS}, alternating
    assert check_capture(InTurn(per_half=True).step, 4, period=2, library=HERE) == []
    assert [v.kind for v in check_capture(InTurn(per_half=True).step, 2, library=HERE)] == [NEW_REGION]


@pytest.mark.parametrize("kind", ["static", "sampled"])
def test_the_engines_steady_steps_pass_the_capture_checker(kind):
    """The DDP hook's steady steps on a small GPT-2 (a region per stretch, per Q buffer and per step kind):
    nothing a graph could not hold, at period 2 over four steps, so that each region's
    call is compared with its call before and each Q buffer's region with the one two steps before."""
    from edgc_probes.capture_check import check_hook_capture
    from edgc_probes.gpt2_layout import gpt2_parameters
    from edgc_probes.hook_steps import sampled_config

    settings = {"config": sampled_config(8)} if kind == "sampled" else {}
    violations = check_hook_capture(gpt2_parameters("tiny"), 4, period=2, rank=8, **settings)
    assert violations == [], "\n".join(map(str, violations))
