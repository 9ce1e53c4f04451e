"""``--input-shape`` longer than the model's positions (or ``--vocab-size`` above its
vocabulary): a usage error (exit 2) in one line naming the flag and the model's line, where a
real card would stop at CUDA's device-side assert."""

from __future__ import annotations

import pytest

from dptune.cli import main
from dptune.errors import EXIT_USAGE

pytest.importorskip("transformers")

GPT2 = ["search", "--model", "dptune.examples.hf:tiny_gpt2", "--simulate", "2x24GB",
        "--max-probes", "3", "--no-plots", "--quiet"]


@pytest.mark.parametrize("flags, index", [
    (["--input-shape", "300", "--vocab-size", "100"], "an index of 299 into an embedding table of 256 rows"),
    (["--input-shape", "16", "--vocab-size", "5000"], "an index of 4999 into an embedding table of 1000 rows"),
], ids=["past-positions", "past-vocabulary"])
def test_input_shape_past_the_models_tables(flags, index, tmp_path, capsys):
    code = main(GPT2 + flags + ["--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    line = [x for x in err.splitlines() if x.startswith("dptune: error:")]
    assert len(line) == 1 and "Traceback" not in err
    assert f"--input-shape {flags[1]} and --vocab-size {flags[3]}" in line[0]
    assert index in line[0] and "modeling_gpt2.py" in line[0]
