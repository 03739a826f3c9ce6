"""bench_scale_out.py: its lists of GPU counts, scalings, strategies and graphed stages are checked before any run,
each error naming the flag, the bad value and what is allowed (a typo gets a suggestion)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_scale_out.py"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gpus", "2,1"], "--gpus '1': the multi-GPU runs need a whole number of at least 2 GPUs"),
        (["--gpus", "four"], "--gpus 'four'"),
        (["--scaling", "weak,strng"], "--scaling 'strng': did you mean 'strong'? allowed strong, weak or both"),
        (["--strategy", "dpp"], "--strategy 'dpp': did you mean 'ddp'? allowed ddp, fsdp or both"),
        (["--graphed", "align,extend"], "--graphed 'extend': allowed align, train or both"),
    ],
)
def test_bad_lists_are_named_before_any_run(tmp_path, flags, message):
    argv = [sys.executable, str(SCRIPT), "recipe.yaml", "--src", "x", "--data", "y", "--out", str(tmp_path / "o")]
    done = subprocess.run(argv + flags, capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "o").exists()  # nothing ran
