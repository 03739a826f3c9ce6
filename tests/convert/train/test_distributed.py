"""Two gloo processes on the CPU (torchrun), as `accelerate launch` runs them on GPUs: align, token weights and train
under ddp and under fsdp (FSDP2) end with the parameters and the table of one process on the same global batch;
a sharded 2-process train checkpoint resumes on one process to the same model, and a 2-process evaluation (also
resumed) writes one process's retrieval answers and perplexities. Four processes, as the 4-GPU machine launches
them, do the same under fsdp and in evaluation.

One process aligns and trains with batch_size 4; the launches with batch_size 2 per process. Raven's Gumbel noise
is off, so that the runs differ only in how the sums are split (float tolerance)."""

import json
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
from tests.helpers import WORDS, assert_same_losses, assert_same_updates, corpus, read_weights, words_corpus

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
        # kd: the teacher sharded too; LoRA: adapters sharded, gathered and merged
        train=STEPS | {"batch_size": rows, "schedule": "constant", "kd_weight": 1.0, "trainable": "mixers+lora"},
        distributed={"strategy": strategy},
    ) | {"data": {"source": str(data), "seq_len": 32, "validation_fraction": 0.1, "cache_dir": str(cache)}}


@pytest.fixture(scope="module")
def one_process(tiny_sources, tmp_path_factory) -> dict:
    """The reference: convert, align, weights and train in this process."""
    root = tmp_path_factory.mktemp("distributed")
    data, cache = corpus(root / "corpus"), root / "cache"
    source = tiny_sources["qwen2"]  # tied embeddings and head: the gathered model keeps them tied
    run_recipe(parse_recipe(recipe(source, data, cache, 1)), root / "converted", stages=["convert"])
    shutil.copytree(root / "converted", root / "one")
    run_recipe(parse_recipe(recipe(source, data, cache, 1)), root / "one", stages=["align", "weights", "train"])
    return {"root": root, "source": source, "data": data, "cache": cache, "run": root / "one"}


def launch(
    setup: dict,
    strategy: str,
    name: str,
    stages: str,
    base: str | None = "converted",
    sections: dict | None = None,
    processes: int = 2,
    **env,
) -> tuple[Path, subprocess.CompletedProcess]:
    """Run `stages` on `processes` processes under torchrun in a copy of the run `base` (default: the converted one;
    None: in the run `name` as it is), the recipe's sections updated with `sections`; (run dir, finished process)."""
    root = setup["root"]
    run = root / name
    if base is not None:
        shutil.copytree(root / base, run)
    path = root / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(recipe(setup["source"], setup["data"], setup["cache"], processes, strategy) | (sections or {}))
    )
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
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", f"--master_port={port}"]
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


def _collectives(rank: int, port: int, out: str) -> None:
    """One of two gloo processes: Parallel's broadcast, gradient mean and sum, results saved to OUT/RANK.pt."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    os.environ.update(env | {"WORLD_SIZE": "2", "ACCELERATE_USE_CPU": "true"})
    from raven_convert.train.distributed import Parallel

    parallel = Parallel()
    torch.manual_seed(rank)  # each process draws its own start, as LoRA's seeded per process
    param = torch.nn.Parameter(torch.randn(3))
    parallel.broadcast_([param])
    param.grad = torch.full((3,), float(rank + 1))
    parallel.average_gradients([param])
    total = parallel.sum_(torch.tensor([float(rank + 1)]))
    torch.save({"param": param.detach(), "grad": param.grad, "sum": total}, f"{out}/{rank}.pt")


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on the CPU; the 2-GPU tests cover NCCL")
def test_two_processes_share_the_main_ones_weights_and_average_their_gradients(tmp_path):
    """What a stage that averages its gradients itself does in place of a DistributedDataParallel wrapper
    (stage 2's graphs under ddp): the main process's start on both, the mean of the gradients, the sum of a value."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_collectives, args=(port, str(tmp_path)), nprocs=2)
    torch.manual_seed(0)
    main_start = torch.randn(3)
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(got["param"], main_start)
        assert torch.equal(got["grad"], torch.full((3,), 1.5)) and got["sum"].item() == 3.0


def _shard_rows(rank: int, port: int, out: str) -> None:
    """One of two gloo processes: a unit sharded from parameters on the host, one with a tied pair, and the model."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    os.environ.update(env | {"WORLD_SIZE": "2", "ACCELERATE_USE_CPU": "true"})
    from torch import nn

    from raven_convert.train.distributed import DistributedSettings, Parallel

    parallel = Parallel(DistributedSettings(strategy="fsdp"))
    torch.manual_seed(0)  # the same model on both processes
    model = nn.Sequential(nn.Linear(8, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5)), nn.Linear(5, 2))
    model[0].register_buffer("scale", torch.tensor([2.0]))
    model[1][1].weight = model[1][0].weight  # tied
    x = torch.randn(4, 8)
    expected, host = model(x).detach(), model[0].weight.detach().clone()
    kwargs = parallel._shard_kwargs()
    paths = [parallel._shard_from_host(unit, kwargs) for unit in model[:2]]
    local = model[0].weight.to_local().detach().clone()
    parallel.shard(model, units=[model[1]])  # the tied unit through fully_shard, then the root
    got = {"paths": paths, "local": local, "host": host, "out": model(x).detach(), "expected": expected}
    torch.save(got | {"scale": model[0].scale.detach()}, f"{out}/{rank}.pt")


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on the CPU; the 2-GPU tests cover NCCL")
def test_a_unit_on_the_host_is_sharded_from_each_process_s_own_rows(tmp_path):
    """Parallel.shard's path for parameters on the host (a model mapped from safetensors): each process fills its
    shard with its own rows (torch.chunk's split, 3 and 2 of 5), buffers keep their values, the model computes what
    it did; a unit with tied parameters takes fully_shard's own path."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_shard_rows, args=(port, str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got["paths"] == [True, False] and got["scale"].item() == 2.0
        assert torch.equal(got["local"], torch.chunk(got["host"], 2, dim=0)[rank])
        torch.testing.assert_close(got["out"], got["expected"])


def _main_first(rank: int, port: int, out: str) -> None:
    """One of two gloo processes whose collectives time out after 2 s: the main process's work takes 4 s."""
    import datetime
    import time

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    os.environ.update(env | {"WORLD_SIZE": "2", "ACCELERATE_USE_CPU": "true"})
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
    from raven_convert.train.distributed import Parallel

    def work():
        if rank == 0:
            time.sleep(4)  # a corpus tokenised: longer than a barrier waits
            Path(out, "cache.txt").write_text("packed")
        return Path(out, "cache.txt").read_text()

    result = Parallel().main_first(work, Path(out) / "cache")
    Path(out, f"{rank}.txt").write_text(result)


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on the CPU; the 2-GPU tests cover NCCL")
def test_the_other_processes_outwait_the_main_ones_long_work(tmp_path):
    """The main process tokenises a corpus while the others wait to read its cache (recipe_dataset): they poll for
    its end, so work longer than the process group's timeout (NCCL's 10 minutes; here 2 s) ends no launch, and
    every process reads what the main one cached; its end-of-work file is gone afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_main_first, args=(port, str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"{rank}.txt").read_text() for rank in range(2)] == ["packed", "packed"]
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_align_weight_and_train_as_one(one_process, strategy):
    loads = one_process["root"] / f"loads-{strategy}.log"
    run, done = launch(one_process, strategy, strategy, "align,weights,train", LOG_LOADS=str(loads))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    lines = [line.split() for line in loads.read_text().splitlines()]
    # the teacher (align, weights, train's distillation) is read by one process at a time, in rank order
    events = [line[:2] for line in lines if line[0] != "alive"]
    assert events == [["start", "0"], ["end", "0"], ["start", "1"], ["end", "1"]] * 3, events
    # every stage frees its models before the next starts (FSDP2's reference cycles would keep them on the GPU)
    alive = [line[1:] for line in lines if line[0] == "alive"]
    assert alive == [["0", stage] for stage in ("align", "weights", "train") for _ in range(2)], alive
    for stage in ("align", "train"):
        assert_same_model(run, one_process["run"], stage)
    tables = [torch.load(r / "weights" / "weights.pt", weights_only=True) for r in (run, one_process["run"])]
    torch.testing.assert_close(*tables, rtol=0, atol=0, equal_nan=True)  # NaN: the rows train never reads
    assert not tables[0].isnan().all()
    assert not (run / "train" / "checkpoints").exists()


def test_four_processes_align_weight_and_train_as_one(one_process):
    """Four processes under fsdp (one row each, every weight sharded four ways), as the 4-GPU machine runs the 8B
    plan: align, token weights and train end with one process's models and table, the teacher read in rank order."""
    loads = one_process["root"] / "loads-four.log"
    run, done = launch(one_process, "fsdp", "four", "align,weights,train", processes=4, LOG_LOADS=str(loads))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    events = [line.split()[:2] for line in loads.read_text().splitlines() if not line.startswith("alive")]
    assert events == [[edge, str(rank)] for rank in range(4) for edge in ("start", "end")] * 3, events
    for stage in ("align", "train"):
        assert_same_model(run, one_process["run"], stage)
        assert json.loads((run / stage / "DONE").read_text())["processes"] == 4
    tables = [torch.load(r / "weights" / "weights.pt", weights_only=True) for r in (run, one_process["run"])]
    torch.testing.assert_close(*tables, rtol=0, atol=0, equal_nan=True)


def test_two_processes_run_a_whole_recipe_from_its_source(one_process):
    """A recipe launched on two processes from nothing, as the lab's data-parallel runs start: convert on the main
    process while the other waits for its DONE, then align, weights, train and extend (rows of twice the training
    length) split, each stage's DONE recording the two processes. Convert chooses its layer by aligning mixers (layer
    choice's "mixer" ablation) on the main process alone: a collective in those steps would wait on the other process
    until the launch timed out, as the deep recipe's first 2-GPU run did."""
    words = words_corpus(one_process["root"] / "words")  # the probes need more distinct words than `corpus` has
    sections = {
        "data": {"source": str(words), "seq_len": 32, "validation_fraction": 0.1}
        | {"cache_dir": str(words.parent / "words-cache")},  # out of the corpus folder: layer choice caches there too
        "layers": [{"mixer": "raven", "layers": "auto:1"}],
        "layer_choice": {"window": 8, "samples": 3, "text_rows": 2, "seq_len": 96, "rounds": 1, "batch_size": 4}
        | {"ablation": "mixer", "fit_steps": 2, "fit_rows": 4, "fit_batch_size": 2},
        "extend": STEPS | {"batch_size": 1, "seq_len": 64, "schedule": "constant"},
    }
    run, done = launch(one_process, "ddp", "whole", "convert,align,weights,train,extend", base=None, sections=sections)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "raven mixers aligned for 2 steps" in done.stderr
    assert len(json.loads((run / "convert" / "DONE").read_text())["layer_choice"]["chosen"]) == 1
    for stage in ("convert", "align", "weights", "train", "extend"):
        assert (run / stage / "DONE").is_file(), stage
    assert json.loads((run / "extend" / "DONE").read_text())["processes"] == 2
    assert (run / "extend" / "model" / "config.json").is_file()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_align_as_graphs_to_the_model_they_align_eagerly(one_process):
    """On two GPUs under ddp, align with `cuda_graphs: true` captures its all-reduces in its graphs (NCCL), every
    process padding its documents to the layout they agree on, and ends with the eager launch's model (float
    tolerance); each process captured its graphs (the stage's summary counts the layouts)."""
    runs = {}
    for graphs in (True, False):
        sections = {"align": STEPS | {"batch_size": ROWS // 2, "cuda_graphs": graphs}}
        runs[graphs], done = launch(one_process, "ddp", f"gpus-graphs-{graphs}", "align", sections=sections)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    summary = json.loads((runs[True] / "align" / "DONE").read_text())
    assert summary.get("graph_layouts", 0) >= 1, summary
    assert_same_model(runs[True], runs[False], "align")


def test_two_processes_train_on_the_graphs_layout_to_the_same_model(one_process):
    """The layout a graphed train stage replays on two GPUs, run eagerly on the CPU (launched.py's GRAPH_LAYOUT):
    each process's documents padded to the slots of every process's share (run_document_slots over the shares) and
    the in-chunk forms chosen on the device train to the one-process model, so the 2-GPU test's eager reference on
    that layout is the plain run's."""
    run, done = launch(one_process, "ddp", "graph-layout", "align,weights,train", GRAPH_LAYOUT="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stderr.count("eager steps on the graphs' layout: documents padded to") == 1  # the main process's
    assert_same_model(run, one_process["run"], "train")


def test_two_processes_train_through_the_graphed_step_to_the_same_model(one_process):
    """The step a graphed train stage captures on several GPUs, run eagerly on the CPU (launched.py's
    STEP_AS_GRAPHS): no DistributedDataParallel wrapper, LoRA's weights broadcast from the main process, the
    gradients averaged and the losses summed by the step itself, every process's share padded to the run's slots,
    fused AdamW. Two processes train to the one-process model, so what the 2-GPU test adds is the capture."""
    train = STEPS | {"batch_size": ROWS // 2, "schedule": "constant", "kd_weight": 1.0, "trainable": "mixers+lora"}
    sections = {"train": train}
    run, done = launch(one_process, "ddp", "as-graphs", "align,weights,train", sections=sections, STEP_AS_GRAPHS="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "CUDA graphs: documents padded" in done.stderr
    assert_same_model(run, one_process["run"], "train")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_train_as_graphs_to_the_model_they_train_eagerly(one_process):
    """On two GPUs under ddp, train with `cuda_graphs: true` trains its model without a DistributedDataParallel
    wrapper: LoRA's weights, drawn per process, broadcast from the main one; the gradients averaged and the losses
    summed inside the graph (NCCL); every process's share padded to one layout. From one aligned model it ends with
    the eager launch's model on the same layout (GRAPH_LAYOUT), within twice what the same eager steps from starting
    weights 2^-20 apart leave, as test_graphs compares one GPU's runs: Adam carries the GPU's rounding into
    zero-started weights (an elementwise tolerance failed in round 9: its lab note)."""
    start, done = launch(one_process, "ddp", "gpus-train-start", "align,weights")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    train = STEPS | {"batch_size": ROWS // 2, "schedule": "constant", "trainable": "mixers+lora"}
    layout = {"GRAPH_LAYOUT": "1"}
    runs, kinds = {}, {"graphed": {}, "eager": layout, "nudged": layout | {"NUDGE": str(2**-20)}}
    for kind, env in kinds.items():
        sections = {"train": train | {"cuda_graphs": kind == "graphed"}}
        base, name = "gpus-train-start", f"gpus-train-{kind}"
        runs[kind], done = launch(one_process, "ddp", name, "train", base=base, sections=sections, **env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        assert ("CUDA graphs: documents padded" in done.stderr) == (kind == "graphed")
    assert json.loads((runs["graphed"] / "train" / "DONE").read_text()).get("graph_layouts") == 1
    initial = read_weights(start / "align" / "model")
    weights = {kind: read_weights(run / "train" / "model") for kind, run in runs.items()}
    trained = {n: v for n, v in weights["eager"].items() if not torch.equal(v, initial[n])}
    assert any(".self_attn." in n for n in trained) and len(trained) < len(initial)  # mixers and LoRA's targets
    for name in set(initial) - set(trained):
        assert torch.equal(weights["graphed"][name], initial[name]), f"{name} is frozen"
    assert_same_updates(weights["graphed"], trained, initial, rounding=weights["nudged"])
    losses = {
        kind: [r["loss"] for r in json.loads((run / "train" / "history.json").read_text())["history"]]
        for kind, run in runs.items()
    }
    assert len(losses["eager"]) == STEPS["steps"]
    assert_same_losses(losses["graphed"], losses["eager"], losses["nudged"])


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


def evaluation(root: Path, data: Path) -> dict:
    """An evaluate section for the tiny hybrid: 2 tasks, each 2 lengths x 2 depths x 2 samples in batches of 3 (uneven
    shares of retrieval batches), perplexity on 3 windows at 2 lengths, speed and pictures (main process only)."""
    essays = root / "essays"
    if not essays.is_dir():
        essays.mkdir()
        (essays / "essay.txt").write_text("\n\n".join(f"Paragraph {i}. " + " ".join(WORDS) + "." for i in range(40)))
    return {
        "tasks": ["passkey", "niah_single_2"],
        "lengths": [400, 480],
        "depths": [0.0, 1.0],
        "samples": 2,
        "batch_size": 3,
        "haystack_dir": str(essays),
        "ppl_data": str(data),
        "ppl_lengths": [16, 24],
        "ppl_windows": 3,
        "speed_lengths": [16],
        "speed_batches": [1],
        "picture_length": 300,
    }


@pytest.fixture(scope="module")
def one_evaluation(one_process) -> Path:
    """The reference run extended and evaluated (`evaluation`'s section) in this process, on one thread as each
    launched process runs (OMP_NUM_THREADS=1): the same float sums."""
    setup, root = one_process, one_process["root"]
    shutil.copytree(setup["run"], root / "eval_one")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = recipe(setup["source"], setup["data"], setup["cache"], 1)
        single |= {"evaluate": evaluation(root, setup["data"])}
        run_recipe(parse_recipe(single), root / "eval_one", stages=["extend", "evaluate"])
    finally:
        torch.set_num_threads(threads)
    return root / "eval_one"


def assert_evaluated_as_one(run: Path, reference: Path) -> dict:
    """`run`'s evaluation has the reference's retrieval answers and perplexities, with speed and pictures; its
    report."""
    ours, theirs = (json.loads((r / "evaluate" / "report.json").read_text()) for r in (run, reference))
    assert ours["finished"] == theirs["finished"] and "failed" not in ours and set(ours["pictures"])
    assert ours["retrieval"] == theirs["retrieval"] and set(ours["retrieval"]) == {
        "passkey/standard",
        "niah_single_2/standard",
    }
    for name in ("retrieval_passkey_standard.json", "retrieval_niah_single_2_standard.json"):
        answers = [json.loads((r / "evaluate" / name).read_text())["results"] for r in (run, reference)]
        assert answers[0] == answers[1] and len(answers[0]) == 8
    lengths = [without_timing(r["perplexity"]["results"]) for r in (ours, theirs)]
    assert lengths[0] == lengths[1] and [e["windows"] for e in lengths[0]] == [3, 3]
    assert [e["context_length"] for e in ours["speed"]] == [16]
    return ours


def without_timing(results: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in ("seconds", "tokens_per_second")} for e in results]


def test_two_processes_evaluate_as_one(one_process, one_evaluation):
    """Retrieval answers and perplexities of a 2-process evaluation are one process's; speed and pictures come from
    the main process. A resumed 2-process evaluation runs only the part report.json has not finished, on both
    processes."""
    setup, root = one_process, one_process["root"]
    sections = {"evaluate": evaluation(root, setup["data"])}
    run, done = launch(setup, "ddp", "eval_two", "extend,evaluate", base="one", sections=sections)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ours = assert_evaluated_as_one(run, one_evaluation)
    (run / "evaluate" / "DONE").unlink()
    ours["finished"].remove("perplexity")
    (run / "evaluate" / "report.json").write_text(json.dumps(ours))
    _, done = launch(setup, "ddp", "eval_two", "evaluate", base=None, sections=sections)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stderr.count("resuming: retrieval passkey (standard), ") == 1 and "8 prompts" not in done.stderr
    resumed = json.loads((run / "evaluate" / "report.json").read_text())
    assert resumed["finished"][-1] == "perplexity" and (run / "evaluate" / "DONE").is_file()
    assert without_timing(resumed["perplexity"]["results"]) == without_timing(ours["perplexity"]["results"])


def test_four_processes_evaluate_as_one(one_process, one_evaluation):
    """Split four ways, the shares are uneven (retrieval batches of up to 3 prompts, 3 perplexity windows a length,
    fewer than the processes): the answers and perplexities are still one process's."""
    setup = one_process
    sections = {"evaluate": evaluation(setup["root"], setup["data"])}
    run, done = launch(setup, "ddp", "eval_four", "extend,evaluate", base="one", sections=sections, processes=4)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert_evaluated_as_one(run, one_evaluation)
