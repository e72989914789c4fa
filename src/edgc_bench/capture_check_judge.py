"""The capture checker's verdict (`edgc_bench.capture_check`): the record of the checked steps
(`edgc_bench.capture_check_trace.Trace`) turned into violations, each said once, where it is made."""

from __future__ import annotations

from dataclasses import dataclass

from .capture_check_trace import Call, OpRecord, StepTrace, Trace

OP_SEQUENCE = "op sequence"
ARGUMENTS = "arguments"
FRESH_BUFFER = "fresh buffer"
CHANGED_BUFFER = "changed buffer"
UNDECLARED = "undeclared buffer"
HOST_SYNC = "host sync"
DATA_DEPENDENT = "data-dependent size"
COLLECTIVE = "collective in region"
WAIT = "wait in region"
NEW_REGION = "new region"
KINDS = (
    OP_SEQUENCE,
    ARGUMENTS,
    FRESH_BUFFER,
    CHANGED_BUFFER,
    UNDECLARED,
    HOST_SYNC,
    DATA_DEPENDENT,
    COLLECTIVE,
    WAIT,
    NEW_REGION,
)


@dataclass(frozen=True)
class Violation:
    """What breaks capture: its ``kind`` (one of `KINDS`), the region (or stretch of work) it is in, the
    site (``file:line (function)``) to change, and what is wrong."""

    kind: str
    region: str
    site: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} in {self.region}, at {self.site}: {self.detail}"


def _name(call: Call | None) -> str:
    return call.name if call is not None else "the step"


class _Found:
    def __init__(self):
        self.violations: list[Violation] = []
        self._seen: set[tuple] = set()

    def add(self, kind: str, region: str, site: str, detail: str) -> None:
        """Once per kind and line to change (a line in several regions' work is changed once)."""
        if (kind, site) not in self._seen:
            self._seen.add((kind, site))
            self.violations.append(Violation(kind, region, site, detail))


def judge(trace: Trace, period: int = 1) -> list[Violation]:
    """The violations of the steps in ``trace``, each step against the ``period``-th before it. Where
    any step called a region, the regions are judged; else the library's stretches of work."""
    explicit = any(call.explicit for step in trace.steps for call in step.calls)
    found = _Found()
    for kind, call, site, detail in trace.found:
        found.add(kind, _name(call), site, detail)
    for birth, used in trace.escapes.values():
        if birth.call.explicit == explicit:
            site = birth.frame.site if birth.frame is not None else birth.op
            found.add(
                FRESH_BUFFER,
                birth.call.name,
                site,
                f"{birth.describe(site=False)} makes a new storage at every call, used after it by {used}: "
                "a buffer that crosses a region's boundary is made once and kept",
            )
    for k in range(period, len(trace.steps)):
        earlier, later = trace.steps[k - period], trace.steps[k]
        _compare_ops(_judged(earlier, explicit), _judged(later, explicit), k, period, found)
        _compare_calls(trace, earlier, later, explicit, found)
    if explicit:
        _undeclared(trace, found)
    return found.violations


def _judged(step: StepTrace, explicit: bool) -> list[OpRecord]:
    if explicit:
        return [op for op in step.ops if op.call is not None and op.call.explicit]
    return [op for op in step.ops if op.library]


def _differences(earlier: tuple, later: tuple) -> str:
    if len(earlier) != len(later):
        return f"{len(earlier)} arguments before, {len(later)} now"
    pairs = [(j, a, b) for j, (a, b) in enumerate(zip(earlier, later)) if a != b]
    return "; ".join(f"argument {j}: {a} before, {b} now" for j, a, b in pairs[:3])


def _compare_ops(earlier: list[OpRecord], later: list[OpRecord], k: int, period: int, found: _Found) -> None:
    before = k - period
    for i, (a, b) in enumerate(zip(earlier, later)):
        if a.op != b.op or _name(a.call) != _name(b.call):
            found.add(
                OP_SEQUENCE,
                _name(b.call),
                b.site,
                f"operator {i} of step {k} is {b.op} (in {_name(b.call)}) where step {before} ran {a.op} "
                f"at {a.site} (in {_name(a.call)})",
            )
            return
        if a.signature != b.signature:
            found.add(
                ARGUMENTS,
                _name(b.call),
                b.site,
                f"{b.op} between steps {before} and {k}: " + _differences(a.signature, b.signature),
            )
    if len(earlier) != len(later):
        extra = (later if len(later) > len(earlier) else earlier)[min(len(earlier), len(later))]
        found.add(
            OP_SEQUENCE,
            _name(extra.call),
            extra.site,
            f"step {k} ran {len(later)} operators, step {before} {len(earlier)}; the first one of only one "
            f"of them: {extra.op}",
        )


def _keyed(step: StepTrace, explicit: bool) -> dict:
    """The step's judged calls by place: (name, occurrence) of a region; the order of a stretch."""
    keyed, seen = {}, {}
    for call in step.calls:
        if call.explicit != explicit:
            continue
        if explicit:
            seen[call.name] = seen.get(call.name, -1) + 1
            keyed[(call.name, seen[call.name])] = call
        else:
            keyed[len(keyed)] = call
    return keyed


def _compare_calls(trace: Trace, earlier: StepTrace, later: StepTrace, explicit: bool, found: _Found) -> None:
    before = _keyed(earlier, explicit)
    for place, call in _keyed(later, explicit).items():
        old = before.get(place)
        if old is None:
            continue  # the operators differ, said once
        if explicit and old.region is not call.region:
            found.add(
                NEW_REGION,
                call.name,
                next(iter(call.inputs.values()), ("", "?"))[1],
                "not the GraphRegion called here the step before: a region is made once and kept, or it "
                "captures at every step",
            )
        if len(old.inputs) != len(call.inputs):
            continue  # the operators differ too
        for old_key, (key, (op, site)) in zip(old.inputs, call.inputs.items()):
            birth = trace.births.get(key)
            if key == old_key or (birth is not None and birth.call is not None and birth.call.explicit == explicit):
                continue  # the same storage, or one made in a call: its fresh buffer is said where it is made
            made = birth.describe() if birth is not None else "before the checked steps"
            found.add(
                CHANGED_BUFFER,
                call.name,
                birth.frame.site if birth is not None and birth.frame is not None else site,
                f"{op} at {site} uses a storage that is not the one the step before used there: made {made}",
            )


def _undeclared(trace: Trace, found: _Found) -> None:
    for step in trace.steps:
        for call in step.calls:
            if not call.explicit:
                continue
            for key, (op, site) in call.inputs.items():
                if key in call.declared:
                    continue
                birth = trace.births.get(key)
                made = birth.describe() if birth is not None else "before the checked steps"
                found.add(
                    UNDECLARED,
                    call.name,
                    site,
                    f"{op} uses a storage made {made} that is not among the region's buffers: a replay "
                    "would not notice it change",
                )
