"""docs/extending.md's compressor through the bench's methods: once its file is imported (which
registers it) `edgc bench` takes it and hands it to `edgc train`, and knows it neither before the
import nor after the registration is undone (the page's other tools: tests/train/test_extending.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # extension_page
from extension_page import page_extensions  # noqa: E402

from edgc_bench.run import BenchSettings, all_methods, check_methods, train_args  # noqa: E402


def test_a_compressor_in_one_file_is_a_bench_method_only_while_its_registration_holds(tmp_path):
    assert "int8" not in all_methods()
    with page_extensions(tmp_path):
        assert "int8" in all_methods() and check_methods(["none", "int8"]) == ["none", "int8"]
        argv = train_args(BenchSettings(), "int8", tmp_path / "bench", r_max=None)
        assert argv[argv.index("--compressor") + 1] == "int8" and "--compress-ratio" not in argv  # it takes no ratio
    assert "int8" not in all_methods()
