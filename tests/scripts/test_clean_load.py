"""scripts/tools/clean_load.sh: a converted model loads and generates where the toolkit cannot be imported."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from raven_convert.cli import main

pytestmark = pytest.mark.transformers_api

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tools" / "clean_load.sh"


def run(model: Path, out: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), str(model), str(out)], env=env, capture_output=True, text=True, timeout=600
    )


MIXER_FLAGS = {
    "raven": ["--raven-num-slots", "8", "--raven-top-k", "2"],
    "sse": ["--sse-lora-rank", "8", "--sse-top-k", "2"],
    "sila": [],
}


@pytest.mark.parametrize("mixer", sorted(MIXER_FLAGS))
def test_cached_decoding_equals_a_full_forward_without_the_toolkit(tiny_sources, tmp_path, mixer):
    # the exported remote code drives the cache of whichever transformers is installed (CI: newest and oldest)
    model = tmp_path / "hybrid"
    args = ["--src", str(tiny_sources["llama"]), "--out", str(model), "--mixer", mixer, "--layers", "0,2"]
    assert main(args + MIXER_FLAGS[mixer] + ["--sliding-window", "64", "--window-layers", "1"]) == 0  # wraps
    proc = run(model, tmp_path / "check.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "check.json").read_text())
    assert record["problems"] == [] and record["transformers"] == transformers.__version__
    for generation in (record["short"], record["long"]):
        assert generation["cached_decode_error"] < 1e-4, (transformers.__version__, generation)


def test_converted_model_loads_and_generates_without_the_toolkit(tiny_sources, tmp_path):
    model = tmp_path / "hybrid"
    args = ["--src", str(tiny_sources["llama"]), "--out", str(model), "--mixer", "sila", "--layers", "0"]
    assert main(args + ["--mixer", "raven", "--layers", "2", "--raven-num-slots", "8", "--raven-top-k", "2"]) == 0
    proc = run(model, tmp_path / "check.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "check.json").read_text())
    assert record["problems"] == []
    assert record["module"].startswith("transformers_modules")
    assert record["layer_mixers"][:3] == ["sila", "attention", "raven"]
    short, long = record["short"], record["long"]
    assert short["new_tokens"] == long["new_tokens"] == 16 and long["prompt_tokens"] > 20 * short["prompt_tokens"]
    assert short["state_bytes"]["mixer"] == long["state_bytes"]["mixer"] > 0
    assert long["state_bytes"]["attention"] > short["state_bytes"]["attention"]


def test_a_plain_model_is_refused_by_name(tiny_sources, tmp_path):
    proc = run(tiny_sources["llama"], tmp_path / "check.json")
    assert proc.returncode != 0
    assert "LlamaForCausalLM, not a hybrid" in proc.stderr
    assert not (tmp_path / "check.json").exists()


@pytest.mark.parametrize("damage", ["unknown layer", "length mismatch", "deleted shard"])
def test_a_damaged_export_is_named_in_one_line(damage, tiny_sources, tmp_path):
    model = tmp_path / "hybrid"
    args = ["--src", str(tiny_sources["llama"]), "--out", str(model), "--mixer", "sila", "--layers", "0"]
    assert main(args) == 0
    config = json.loads((model / "config.json").read_text())
    if damage == "unknown layer":
        config["layer_mixers"][1] = "mamba"
    elif damage == "length mismatch":
        config["layer_mixers"] = config["layer_mixers"][:-1]
    else:
        next(model.glob("*.safetensors")).unlink()
    (model / "config.json").write_text(json.dumps(config))
    proc = run(model, tmp_path / "check.json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("clean_load:")]
    assert line.startswith(f"clean_load: {model} does not load: ")
    assert {"unknown layer": "mamba", "length mismatch": "layer_mixers", "deleted shard": "safetensors"}[damage] in line
    assert not (tmp_path / "check.json").exists()
