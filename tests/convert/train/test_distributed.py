"""Two gloo processes on the CPU (torchrun), as `accelerate launch` runs them on GPUs: align, token weights and train
under ddp and under fsdp (FSDP2) end with the parameters and the table of one process on the same global batch, and
a sharded 2-process train checkpoint resumes on one process to the same model.

One process aligns and trains with batch_size 4; the launches with batch_size 2 per process. Raven's Gumbel noise
is off, so that the runs differ only in how the sums are split (float tolerance)."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from raven_convert.train.recipe import parse_recipe
from raven_convert.train.stages import run_recipe
from tests.convert.faults import recipe_data
from tests.helpers import corpus, read_weights

pytestmark = [
    pytest.mark.usefixtures("private_datasets_cache"),
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="torch.distributed with gloo is not available",
    ),
]
STEPS = {"steps": 4, "lr": 1e-2, "save_every": 2, "log_every": 1}
ROWS = 4  # the global batch


def recipe(source: Path, data: Path, cache: Path, processes: int, strategy: str = "ddp") -> dict:
    rows = ROWS // processes
    return recipe_data(
        source,
        data,
        mixer_settings={"raven": {"num_slots": 8, "top_k": 2, "gumbel": False}},
        align=STEPS | {"batch_size": rows},
        token_weights={"enabled": True, "batch_size": 8},
        train=STEPS | {"batch_size": rows, "schedule": "constant", "kd_weight": 1.0},  # kd: the teacher sharded too
        distributed={"strategy": strategy},
    ) | {"data": {"source": str(data), "seq_len": 32, "validation_fraction": 0.1, "cache_dir": str(cache)}}


@pytest.fixture(scope="module")
def one_process(tiny_sources, tmp_path_factory) -> dict:
    """The reference: convert, align, weights and train in this process."""
    root = tmp_path_factory.mktemp("distributed")
    data, cache = corpus(root / "corpus"), root / "cache"
    source = tiny_sources["llama"]
    run_recipe(parse_recipe(recipe(source, data, cache, 1)), root / "converted", stages=["convert"])
    shutil.copytree(root / "converted", root / "one")
    run_recipe(parse_recipe(recipe(source, data, cache, 1)), root / "one", stages=["align", "weights", "train"])
    return {"root": root, "source": source, "data": data, "cache": cache, "run": root / "one"}


def launch(setup: dict, strategy: str, name: str, stages: str, **env) -> tuple[Path, subprocess.CompletedProcess]:
    """Run `stages` on 2 processes under torchrun in a copy of the converted run; (run dir, finished process)."""
    root = setup["root"]
    run = root / name
    shutil.copytree(root / "converted", run)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe(setup["source"], setup["data"], setup["cache"], 2, strategy)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[3]
    environment = (
        os.environ
        | env
        | {
            "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
            "HF_DATASETS_CACHE": str(root / "hf"),
            "OMP_NUM_THREADS": "1",
        }
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={port}"]
    command += ["-m", "tests.convert.train.launched", str(path), "--run-dir", str(run), "--stages", stages]
    done = subprocess.run(command, env=environment, cwd=repo, capture_output=True, text=True, timeout=600)
    return run, done


def assert_same_model(run: Path, reference: Path, stage: str) -> None:
    """`stage`'s model in `run` is the reference run's (float tolerance: Adam magnifies the rounding of near-zero
    gradients, summed in another order), and differs from the converted model."""
    ours, theirs = (read_weights(r / stage / "model") for r in (run, reference))
    converted = read_weights(reference.parent / "converted" / "convert" / "model")
    assert set(ours) == set(theirs) and any(not torch.equal(theirs[n], converted[n]) for n in theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-3, atol=1e-4, msg=f"{stage}: {name}")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_align_weight_and_train_as_one(one_process, strategy):
    run, done = launch(one_process, strategy, strategy, "align,weights,train")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    for stage in ("align", "train"):
        assert_same_model(run, one_process["run"], stage)
    tables = [torch.load(r / "weights" / "weights.pt", weights_only=True) for r in (run, one_process["run"])]
    assert torch.equal(*tables)
    assert not (run / "train" / "checkpoints").exists()


def test_a_two_process_fsdp_checkpoint_resumes_on_one_process(one_process):
    run, done = launch(one_process, "fsdp", "stopped", "align,weights,train", STOP_AFTER_STEP="2")
    assert done.returncode != 0 and (run / "train" / "checkpoints" / "step_2").is_dir(), done.stderr[-5000:]
    assert not (run / "train" / "DONE").exists()
    setup = one_process
    summary = run_recipe(
        parse_recipe(recipe(setup["source"], setup["data"], setup["cache"], 1, "fsdp")), run, stages=["train"]
    )
    assert summary["train"]["steps_this_run"] == 2
    assert_same_model(run, one_process["run"], "train")
