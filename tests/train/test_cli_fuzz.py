"""Hypothesis drives `edgc train`'s flag parsing: a value is accepted into a valid TrainConfig or
rejected with a one-line CLIError (or argparse's usage error) — never a crash deep inside."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgc_cli.errors import CLIError
from edgc_cli.main import build_parser
from edgc_train.cli import resolve
from edgc_train.config import TrainConfig

FIELDS = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in ("edgc", "data", "cache_dir")]
VALUES = st.one_of(
    st.integers(-(10**9), 10**9).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "none", "true", "1e400", "-0", "0x10", "nan", "edgc", "gpipe", "tiny"]),
    st.text(max_size=6),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=VALUES, edgc_value=VALUES)
def test_fuzzed_train_flags_give_a_clear_answer(tmp_path, field, value, edgc_value):
    parser = build_parser(only="train")
    flag = "--" + field.replace("_", "-")
    argv = ["train", "--out", str(tmp_path / "run"), flag, value, "--edgc", f"window={edgc_value}"]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage line + exit code 2 (e.g. a value for a boolean flag)
        assert exc.code == 2
        return
    try:
        cfg, run_dir, resume, _ = resolve(args, 1)
    except CLIError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    assert isinstance(cfg, TrainConfig) and not resume and not run_dir.exists()
