"""Training steps as CUDA graphs (align and stage 2): padded document layouts change nothing, the settings are
checked before a model loads, and on a GPU (`python -m pytest -m gpu`) graphed steps compute what eager ones do."""

import copy
import dataclasses
import itertools
import os

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.train import stage2
from raven_convert.train.align import align, alignment_losses, step_inputs
from raven_convert.train.common import mixer_parameters
from raven_convert.train.data import PackedDataset, batch_iterator
from raven_convert.train.distributed import Parallel
from raven_convert.train.graphs import (
    CapturedStep,
    StepInputs,
    agreed_slots,
    documents_per_row,
    graph_inputs,
    host_documents,
    optimizer_mode,
    pad_documents,
    resolve_graphs,
    run_document_slots,
    set_lr,
)
from raven_convert.train.lora import add_lora
from raven_convert.train.recipe import Recipe
from raven_convert.train.stage2 import step_graphs, train
from raven_convert.train.stage2_config import TrainConfig
from raven_kernels import chunked
from raven_kernels.raven import chunk as raven_chunk
from raven_kernels.sse import chunk as sse_chunk
from raven_layers import registry
from raven_layers.backend import use_backend
from raven_layers.masks import find_packed_documents
from tests.conftest import tiny_config
from tests.helpers import assert_same_losses, assert_same_updates

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def packed_rows(rows: int, length: int, longest: int, generator: torch.Generator) -> dict:
    """input_ids and position_ids [rows, length] of random documents of 1 to `longest` tokens packed back to back."""
    positions = []
    for _ in range(rows):
        row, left = [], length
        while left:
            n = min(left, int(torch.randint(1, longest + 1, (), generator=generator)))
            row.append(torch.arange(n))
            left -= n
        positions.append(torch.cat(row))
    return {
        "input_ids": torch.randint(3, 100, (rows, length), generator=generator),
        "position_ids": torch.stack(positions),
    }


def hybrid_models(device="cpu", layers: str = "0,2", mixer: str = "sila"):
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama")).to(device).eval()
    settings = {"sse": {"lora_rank": 8}} if mixer == "sse" else {}
    return teacher, build_hybrid(teacher, plan_layers([(mixer, layers)], 4), settings).to(device)


GRAPHED_MIXERS = [spec.name for spec in registry.BUILTIN_MIXERS]  # each captured by the GPU tests


def declared_graph_safe(monkeypatch, mixer: str, safe: bool = True) -> None:
    """The registry's `mixer` declared graph_safe (or, with safe=False, not) for this test, and SSE's and Raven's
    state scan pinned to the sequential kernel: it is chosen from the documents' count, which padding raises past the
    split form's range, so an eager run on unpadded documents would scan otherwise and round otherwise on a GPU."""
    spec = registry.get_mixer(mixer)
    monkeypatch.setitem(registry._mixers, mixer, dataclasses.replace(spec, graph_safe=safe))
    monkeypatch.setattr(sse_chunk, "split_scan", lambda programs: False)
    monkeypatch.setattr(raven_chunk, "split_scan", lambda M, D, NH: False)


def test_pad_documents_adds_empty_documents_up_to_the_bucket():
    cu = torch.tensor([0, 5, 9, 40], dtype=torch.int32)
    padded = pad_documents(cu, 4)
    assert padded.tolist() == [0, 5, 9, 40, 40] and padded.dtype == torch.int32
    assert pad_documents(cu, 3).tolist() == cu.tolist()  # already a multiple
    assert pad_documents(cu, 64).shape == (65,)
    assert pad_documents(cu, 4, slots=10).tolist() == [0, 5, 9, 40] + [40] * 7  # exactly the run's slots
    assert pad_documents(cu, 4, slots=2).tolist() == [0, 5, 9, 40, 40]  # more than the slots: to the bucket
    with pytest.raises(ValueError, match="bucket = 0"):
        pad_documents(cu, 0)


def test_step_inputs_pads_the_documents_found_on_the_host():
    batch = packed_rows(2, 32, 6, torch.Generator().manual_seed(0))
    documents, cu = find_packed_documents(batch["position_ids"])
    inputs, packed = step_inputs(batch, "cpu", bucket=16)
    assert torch.equal(packed[0], documents) and packed[1].numel() % 16 == 1
    assert torch.equal(packed[1][: cu.numel()], cu) and (packed[1][cu.numel() :] == 64).all()
    assert torch.equal(inputs["position_ids"], batch["position_ids"])
    assert step_inputs(batch, "cpu")[1][1].numel() == cu.numel()  # no bucket: as found


# SSE's and Raven's kernels take minutes under the interpreter here (both forms run where chosen on the device),
# past the suite's budget: opt in with RAVEN_LONG_TESTS=1 (docs/lab/TRAINING_SPEED.md has the runs)
long_interpreted = pytest.mark.skipif(
    not os.environ.get("RAVEN_LONG_TESTS"), reason="minutes of interpreted kernels: set RAVEN_LONG_TESTS=1"
)


@pytest.mark.parametrize(
    "mixer", ["sila", pytest.param("sse", marks=long_interpreted), pytest.param("raven", marks=long_interpreted)]
)
def test_padded_documents_change_no_loss_or_gradient(mixer, monkeypatch):
    """What a graph runs (offsets padded with empty documents; SSE's and Raven's in-chunk forms chosen on the device,
    as inside a capture) against what the eager step runs, through each mixer's kernels (interpreted on the CPU)
    and SILA's PyTorch form. Exactly: on a GPU the two differ by rounding alone, so the GPU tests compare graphs
    with eager steps on the graph's own layout."""
    teacher, hybrid = hybrid_models(layers="2", mixer=mixer)
    batch = packed_rows(2, 24, 7, torch.Generator().manual_seed(1))
    for backend in ("triton", "torch") if mixer == "sila" else ("triton",):
        runs = []
        for bucket in (None, 32):
            monkeypatch.setattr(chunked, "FORCE_DEVICE_CHOICE", bucket is not None)
            hybrid.zero_grad(set_to_none=True)
            inputs, packed = step_inputs(batch, "cpu", bucket)
            with use_backend(backend):
                torch.manual_seed(0)  # Raven's router noise
                losses = alignment_losses(teacher, hybrid, **inputs, packed=packed)
                sum(losses.values()).backward()
            runs.append(([v.item() for v in losses.values()], [p.grad.clone() for p in mixer_parameters(hybrid)]))
        (plain, plain_grads), (padded, padded_grads) = runs
        assert padded == pytest.approx(plain, rel=1e-6), backend
        for a, b in zip(plain_grads, padded_grads):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_every_builtin_mixer_is_declared_graph_safe():
    assert GRAPHED_MIXERS and all(registry.get_mixer(name).graph_safe for name in GRAPHED_MIXERS)


def test_graphs_are_used_only_where_they_can_run(monkeypatch):
    declared_graph_safe(monkeypatch, "raven", safe=False)  # a mixer without the declaration
    _, hybrid = hybrid_models()
    assert resolve_graphs(False, hybrid, "cuda") is False
    assert resolve_graphs("auto", hybrid, "cpu") is False
    with pytest.raises(ValueError, match="the device is cpu, not cuda"):
        resolve_graphs(True, hybrid, "cpu")
    with pytest.raises(ValueError, match="2 processes"):
        resolve_graphs(True, hybrid, "cuda", world=2)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    mixed = build_hybrid(teacher, plan_layers([("sila", "0"), ("raven", "2")], 4), {})
    with pytest.raises(ValueError, match=r"\['RavenMixer'\] are not declared graph_safe"):
        resolve_graphs(True, mixed, "cuda")
    assert resolve_graphs("auto", mixed, "cuda") is False
    mixed = build_hybrid(teacher, plan_layers([("sila", "0"), ("sse", "2")], 4), {"sse": {"lora_rank": 8}})
    assert resolve_graphs("auto", mixed, "cuda") is True
    # several processes: only a step that makes its all-reduces itself (under ddp), demanded or by default; not
    # where the step cannot hold them (fsdp)
    assert resolve_graphs(True, mixed, "cuda", world=2, collectives=True) is True
    assert resolve_graphs("auto", mixed, "cuda", world=2, collectives=True) is True
    assert resolve_graphs("auto", mixed, "cuda", world=2, collectives=False) is False
    with pytest.raises(ValueError, match="2 processes"):
        resolve_graphs(True, mixed, "cuda", world=2)
    with pytest.raises(ValueError, match="expected 'auto', true or false"):
        resolve_graphs("yes", hybrid, "cuda")


def test_recipe_refuses_graphs_for_mixers_that_cannot_run_them(monkeypatch):
    declared_graph_safe(monkeypatch, "raven", safe=False)
    base = {"source": "m", "layers": [{"mixer": "raven", "layers": "0-3"}]}
    with pytest.raises(ValueError, match="align.cuda_graphs = true needs mixers declared graph_safe; raven is not"):
        Recipe.model_validate(base | {"align": {"cuda_graphs": True}})
    assert Recipe.model_validate(base | {"align": {"cuda_graphs": "auto"}}).align.cuda_graphs == "auto"
    sila = base | {"layers": [{"mixer": "sila", "layers": "0-3"}], "align": {"cuda_graphs": True}}
    assert Recipe.model_validate(sila).align.cuda_graphs is True
    for stage, settings in (("train", {}), ("extend", {"steps": 1, "seq_len": 64})):
        with pytest.raises(ValueError, match=f"{stage}.cuda_graphs = true needs mixers declared graph_safe; raven"):
            Recipe.model_validate(base | {stage: settings | {"cuda_graphs": True}})


def test_choosing_on_device_is_scoped():
    x = torch.zeros(2)
    assert not chunked.choice_on_device(x)
    with pytest.raises(KeyboardInterrupt), chunked.choosing_on_device():
        assert chunked.choice_on_device(x)  # on any device: the CPU tests take the graphs' path so
        raise KeyboardInterrupt
    assert chunked.FORCE_DEVICE_CHOICE is False and not chunked.choice_on_device(x)


@pytest.mark.gpu
@gpu
def test_captured_steps_warm_up_on_the_capture_path():
    """The eager warm-up before a capture has the kernels choose their forms on the device, as the capture will, so
    the kernel variants it launches compile before it (compiling them during the capture was timed as the step)."""
    seen = []

    def step(inputs):
        seen.append(chunked.choice_on_device(inputs["x"]))
        return inputs["x"] * 2

    captured = CapturedStep(step)
    x = torch.ones(3, device="cuda")
    outputs = [captured({"x": x}).clone() for _ in range(3)]  # warm-up, capture (and its replay), replay
    assert seen == [True, True] and all(torch.equal(o, 2 * x) for o in outputs)
    assert chunked.FORCE_DEVICE_CHOICE is False


def _interrupted(batches: list[dict], after: int):
    """A batch source that fails once `after` batches are drawn (a crash mid-run), resuming where asked."""

    def source(first: int):
        for i, batch in enumerate(itertools.islice(batches, first, None)):
            if first == 0 and i == after:
                raise KeyboardInterrupt
            yield batch

    return source


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("mixer", GRAPHED_MIXERS)
def test_graphed_align_matches_eager_on_cuda(mixer, compile, tmp_path, monkeypatch):
    """Several document buckets (a warm-up step, a capture, then replays each), bf16 autocast as the recipes run,
    with and without the compiled parts; then a run stopped after a checkpoint and resumed with graphs."""
    declared_graph_safe(monkeypatch, mixer)
    teacher, hybrid = hybrid_models("cuda", mixer=mixer)
    generator = torch.Generator().manual_seed(2)
    batches = [packed_rows(2, 256, longest, generator) for longest in (64, 6, 64, 6, 64, 6, 40, 64, 6)]
    runs = {}
    for graphs in (False, True):
        model = copy.deepcopy(hybrid)
        # seeded: Raven's router draws its noise inside the step
        settings = dict(steps=len(batches), lr=3e-3, warmup_steps=2, log_every=0, mixed_precision="bf16", seed=0)
        history = align(teacher, model, iter(batches), compile=compile, cuda_graphs=graphs, **settings)
        runs[graphs] = ([r["loss"] for r in history], [p.detach().clone() for p in mixer_parameters(model)])
        assert history[-1].get("graph_layouts", 0) == (2 if graphs else 0)  # buckets of 64 and 192 documents
    (eager, eager_weights), (graphed, graphed_weights) = runs[False], runs[True]
    assert graphed == pytest.approx(eager, rel=2e-3)
    for a, b in zip(eager_weights, graphed_weights):
        torch.testing.assert_close(b, a, rtol=2e-3, atol=2e-4)

    resumed = copy.deepcopy(hybrid)
    settings |= dict(out_dir=tmp_path / "align", save_every=4, cuda_graphs=True, compile=compile)
    with pytest.raises(KeyboardInterrupt):
        align(teacher, resumed, _interrupted(batches, 6), **settings)
    history = align(teacher, resumed, _interrupted(batches, 6), **settings)
    assert [r["loss"] for r in history] == pytest.approx(eager, rel=2e-3)
    for a, b in zip(eager_weights, mixer_parameters(resumed)):
        torch.testing.assert_close(b.detach(), a, rtol=2e-3, atol=2e-4)


def test_the_processes_shares_of_a_batch_agree_on_one_layout():
    """Under several processes a graphed align pads every process's share of the global batch to the same document
    slots (`agreed_slots`: the most documents a share holds, to a multiple of the bucket), found on each process
    alone, so that all capture and replay one layout at one step."""
    g = torch.Generator().manual_seed(5)
    batch = {k: torch.cat([a, b]) for (k, a), b in zip(packed_rows(2, 64, 4, g).items(),
                                                      packed_rows(2, 64, 40, g).values())}  # fmt: skip
    slots = agreed_slots(batch, world=2, bucket=4)
    shares = [{k: v[r * 2 : (r + 1) * 2] for k, v in batch.items()} for r in range(2)]
    found = [find_packed_documents(share["position_ids"])[1].numel() - 1 for share in shares]
    assert found[0] > found[1] and slots == -(-max(found) // 4) * 4  # the short documents' share decides
    padded = [host_documents(share, 4, slots)[1] for share in shares]
    assert padded[0].shape == padded[1].shape == (slots + 1,)
    assert [p.numel() for p in (host_documents(share, 4)[1] for share in shares)] != [slots + 1] * 2  # alone: apart
    assert agreed_slots({"input_ids": batch["input_ids"]}, world=2) is None


def packed_dataset(generator: torch.Generator, rows: int = 6, length: int = 256) -> PackedDataset:
    """Rows of long documents and rows of short ones (several document buckets), as a PackedDataset."""
    parts = [packed_rows(rows, length, longest, generator) for longest in (64, 6)]
    tensors = {k: torch.cat([part[k] for part in parts]) for k in ("input_ids", "position_ids")}
    tensors["document_ids"] = (tensors["position_ids"] == 0).cumsum(-1) - 1
    return PackedDataset(tensors)


def test_stage2_graphs_only_where_a_step_can_be_one():
    for field, value in (("grad_accum", 2), ("gradient_checkpointing", True)):
        with pytest.raises(ValueError, match=f"cuda_graphs = true cannot be honoured: {field}"):
            TrainConfig(steps=1, cuda_graphs=True, **{field: value})
    assert TrainConfig(steps=1, cuda_graphs="auto", grad_accum=2).cuda_graphs == "auto"
    teacher, hybrid = hybrid_models()
    with pytest.raises(ValueError, match="LlamaForCausalLM is not a hybrid"):
        step_graphs(TrainConfig(steps=1, cuda_graphs=True), teacher, None, "cuda", 1)
    assert step_graphs(TrainConfig(steps=1, cuda_graphs=True), hybrid, lambda batch: None, "cuda", 1) is True
    assert step_graphs(TrainConfig(steps=1, cuda_graphs="auto", grad_accum=2), hybrid, None, "cuda", 1) is False
    assert step_graphs(TrainConfig(steps=1, cuda_graphs="auto"), hybrid, None, "cpu", 1) is False
    assert step_graphs(TrainConfig(steps=1, cuda_graphs="auto"), hybrid, torch.zeros(1, 1), "cuda", 1) is True
    # under ddp (its step holds the all-reduces) stage 2 replays graphs by default; under fsdp it cannot
    assert step_graphs(TrainConfig(steps=1, cuda_graphs="auto"), hybrid, None, "cuda", 2, collectives=True) is True
    assert step_graphs(TrainConfig(steps=1, cuda_graphs="auto"), hybrid, None, "cuda", 2) is False
    distilled = TrainConfig(steps=1, cuda_graphs=True, kd_weight=1.0)  # the teacher's forward inside the step
    assert teacher.config._attn_implementation == "sdpa" and step_graphs(distilled, hybrid, None, "cuda", 1, teacher)
    teacher.config._attn_implementation = "eager"  # builds its packed documents' mask by reading positions back
    with pytest.raises(ValueError, match="the distilling teacher's attention is 'eager'"):
        step_graphs(distilled, hybrid, None, "cuda", 1, teacher)
    assert step_graphs(distilled.model_copy(update={"cuda_graphs": "auto"}), hybrid, None, "cuda", 1, teacher) is False


def position_weights(batch: dict) -> torch.Tensor:
    """Token weights [B, T] computed from a batch on its device (extend's kind), in bf16."""
    return (0.5 + (batch["position_ids"] % 4) / 4).bfloat16()


def test_graph_inputs_lay_a_batch_out_on_the_host():
    data = packed_dataset(torch.Generator().manual_seed(4))
    batch = data.batch(torch.tensor([0, 7])) | {"index": torch.tensor([0, 7])}
    table = torch.rand(len(data), data.seq_len)
    tensors, tokens = graph_inputs(batch, table, "cpu")
    documents, cu = find_packed_documents(batch["position_ids"])
    assert "index" not in tensors and tokens == 2 * data.seq_len
    assert torch.equal(tensors["documents"], documents) and tensors["cu_seqlens"].numel() % 64 == 1
    assert torch.equal(tensors["cu_seqlens"][: cu.numel()], cu)
    assert torch.equal(tensors["weights"], table[[0, 7]])
    tensors, _ = graph_inputs(batch, position_weights, "cpu")  # a function of the batch, as extend's teacher
    assert tensors["weights"].dtype == torch.float32
    assert torch.equal(tensors["weights"], position_weights(batch).float())


def slow_position_weights(batch: dict) -> torch.Tensor:
    """`position_weights` after a kernel that spins on the GPU (about 10 ms) on the stream the weights are made on:
    a step that read them without waiting for that stream would read them unwritten."""
    torch.cuda._sleep(20_000_000)
    return position_weights(batch)


def test_step_inputs_hand_out_each_batch_once_in_order():
    """The inputs a graphed stage 2 step takes are graph_inputs' of its batch: drawn ahead by `prepare` (while the
    step before replays) or, where nothing was prepared, by `take` itself; each batch is drawn once, and only when
    asked for (the last step prepares none after it). Without CUDA the weights are made in place."""
    data = packed_dataset(torch.Generator().manual_seed(6))
    batches = [data.batch(torch.tensor([i, i + 1])) for i in (0, 2, 4)]
    drawn = []

    def source():
        for batch in batches:
            drawn.append(batch)
            yield batch

    inputs = StepInputs(source(), position_weights, "cpu", slots=64)
    assert inputs.stream is None
    taken = [inputs.take()]
    assert len(drawn) == 1
    inputs.prepare()
    assert len(drawn) == 2
    taken += [inputs.take(), inputs.take()]
    assert len(drawn) == 3
    for (tensors, tokens), batch in zip(taken, batches, strict=True):
        expected, expected_tokens = graph_inputs(batch, position_weights, "cpu", 64)
        assert tokens == expected_tokens and tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[name], expected[name]) for name in expected)


@pytest.mark.gpu
@gpu
def test_step_inputs_made_beside_the_step_are_waited_for():
    """Weights computed from each batch are made on a side stream; the main stream reads them finished, even when
    they take long to make, and they are those graph_inputs makes in place."""
    data = packed_dataset(torch.Generator().manual_seed(6))
    batches = [data.batch(torch.tensor([i, i + 1])) for i in (0, 2, 4, 6)]
    assert StepInputs(iter(batches), slow_position_weights, "cuda", slots=64, beside=False).stream is None
    inputs = StepInputs(iter(batches), slow_position_weights, "cuda", slots=64)
    assert inputs.stream is not None
    for i, batch in enumerate(batches):
        tensors, _ = inputs.take()
        read = {name: tensor.clone() for name, tensor in tensors.items()}  # on the main stream, at once
        if i + 1 < len(batches):
            inputs.prepare()  # the next batch's, while the main stream would run this step
        expected, _ = graph_inputs(batch, position_weights, "cuda", 64)
        assert all(torch.equal(read[name], expected[name]) for name in expected)


def test_stage2_pads_every_step_to_the_documents_of_its_fullest_batch():
    """One layout for a whole run (a graph captured once): the slots are the most documents any micro-batch the run
    reads holds, rounded up to the bucket, and every batch's offsets are padded to exactly that many."""
    data = packed_dataset(torch.Generator().manual_seed(5), rows=12, length=128)
    counts = documents_per_row(data.tensors["position_ids"])
    for i in range(len(data)):  # each row's documents as find_packed_documents cuts them
        assert counts[i] == find_packed_documents(data.batch(torch.tensor([i]))["position_ids"])[1].numel() - 1
    slots = run_document_slots(data, batch_size=3, seed=2, micro_batches=9)  # 8 batches an epoch: into a second
    run = list(itertools.islice(batch_iterator(data, 3, seed=2), 9))
    held = [find_packed_documents(b["position_ids"])[1].numel() - 1 for b in run]
    assert slots == -(-max(held) // 64) * 64 and slots >= 128  # the short-document rows: over one bucket
    for batch in run:
        tensors, _ = graph_inputs(batch | {"index": torch.arange(3)}, None, "cpu", slots)
        assert tensors["cu_seqlens"].numel() == slots + 1
    assert run_document_slots([data[i] for i in range(len(data))], 3, 2, 9) is None  # not packed: buckets


def test_stage2_on_several_processes_pads_every_share_to_one_layout():
    """Under ddp each process reads its slice of every global batch (stage2_rows.micro_batches): the run's slots cover
    every process's slice of every step, found alike on each without a collective, as graphs holding NCCL
    all-reduces need."""
    data = packed_dataset(torch.Generator().manual_seed(5), rows=24, length=128)
    slots = run_document_slots(data, batch_size=3, seed=2, micro_batches=6, processes=2)
    held = []
    for batch in itertools.islice(batch_iterator(data, 6, seed=2), 6):  # global batches of 2 x 3 rows
        for rank in range(2):
            share = {k: v[rank * 3 : (rank + 1) * 3] for k, v in batch.items()}
            held.append(int(documents_per_row(share["position_ids"]).sum()))
            tensors, _ = graph_inputs(share | {"index": torch.arange(3)}, None, "cpu", slots)
            assert tensors["cu_seqlens"].numel() == slots + 1
    assert slots == -(-max(held) // 64) * 64  # the fullest share's documents, to the bucket: no more


def test_rows_of_one_document_each_take_the_run_layout_and_change_nothing():
    """Padded for a graph, a batch whose rows are one document each gets documents too (one layout for every step:
    in the SILA recipe such batches cost 4-24 s each, a capture and a compilation of their own), and the student's
    loss and gradients are those of the batch without documents, through SILA's kernels (interpreted on the CPU)
    and its PyTorch form."""
    _, hybrid = hybrid_models(layers="2")
    batch = {"input_ids": torch.randint(3, 100, (2, 24)), "position_ids": torch.arange(24).repeat(2, 1)}
    assert host_documents(batch) is None  # the eager steps: no documents to mark
    assert host_documents(batch, 4)[1].tolist() == [0, 24, 48, 48, 48]  # align's graphs: to the bucket
    documents, cu = host_documents(batch, slots=8)
    assert documents.eq(0).all() and cu.tolist() == [0, 24] + [48] * 7
    for backend in ("triton", "torch"):
        runs = []
        for packed in (False, (documents, cu)):
            hybrid.zero_grad(set_to_none=True)
            with use_backend(backend):
                loss = hybrid(**batch, packed_documents=packed, use_cache=False).logits.float().square().mean()
                loss.backward()
            runs.append((loss.item(), [p.grad.clone() for p in mixer_parameters(hybrid)]))
        (plain, plain_grads), (padded, padded_grads) = runs
        assert padded == pytest.approx(plain, rel=1e-6), backend
        for a, b in zip(plain_grads, padded_grads):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_optimizer_mode_converts_either_way_and_after_a_load():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    optimizer_mode(optimizer, True, "cpu")
    group = optimizer.param_groups[0]
    assert torch.is_tensor(group["lr"]) and group["capturable"] is True
    set_lr(optimizer, 5e-4)
    assert group["lr"].item() == pytest.approx(5e-4)
    saved = optimizer.state_dict()
    optimizer_mode(optimizer, False, "cpu")
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4) and optimizer.param_groups[0]["capturable"] is False
    optimizer.load_state_dict(saved)  # a graph run's checkpoint, resumed eagerly
    optimizer_mode(optimizer, False, "cpu")
    assert isinstance(optimizer.param_groups[0]["lr"], float) and optimizer.param_groups[0]["capturable"] is False


@pytest.mark.parametrize("saved_graphed", [True, False])
def test_stage2_checkpoints_resume_in_either_optimizer_mode(saved_graphed, tmp_path):
    """A graphed run's optimizer (its learning rate a tensor) checkpoints as an eager one's does: stage 2 loads
    into float groups and converts afterwards, so a checkpoint of either mode resumes in the other."""
    parallel = Parallel()

    def model_and_optimizer():
        model = torch.nn.Linear(3, 2)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, optimizer = model_and_optimizer()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    optimizer_mode(optimizer, saved_graphed, "cpu")
    set_lr(optimizer, 4e-4)
    parallel.save(tmp_path, model, optimizer)
    resumed, resumed_optimizer = model_and_optimizer()
    parallel.load(tmp_path, resumed, resumed_optimizer)
    optimizer_mode(resumed_optimizer, not saved_graphed, "cpu")
    assert float(resumed_optimizer.param_groups[0]["lr"]) == pytest.approx(4e-4)
    assert torch.equal(resumed.weight, model.weight)
    saved = optimizer.state[model.weight]["exp_avg_sq"]
    assert torch.equal(resumed_optimizer.state[resumed.weight]["exp_avg_sq"], saved)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("weighting", "kd_weight"), [("table", 0.0), ("function", 0.0), ("table", 1.0)], ids=["table", "function", "kd"]
)
@pytest.mark.parametrize("mixer", GRAPHED_MIXERS)
def test_graphed_stage2_matches_eager_on_cuda(mixer, weighting, kd_weight, tmp_path, monkeypatch):
    """Stage 2 as the recipes run it (mixers and LoRA, bf16, compiled parts, token weights from a table as train's or
    from each batch as extend's, made slowly and beside the step before (StepInputs), answer tokens weighted,
    distillation from the teacher as SSE's and Raven's, packed rows of long and of short documents, padded to one
    layout): the graphed steps' losses and weights are the eager ones'; a graphed run stopped after a checkpoint and
    resumed ends where the uninterrupted one does. The eager steps run on the
    graphs' layout (documents padded to the run's slots, in-chunk forms chosen on the device): that it changes nothing
    is test_padded_documents_change_no_loss_or_gradient's, exactly, on the CPU; on a GPU it changes the rounding, which
    8 Adam steps at lr 3e-3 carry into zero-started weights (docs/lab/TRAINING_SPEED.md): the weights may differ by
    twice what the same eager steps from starting weights 2^-20 apart leave."""
    declared_graph_safe(monkeypatch, mixer)
    teacher, hybrid = hybrid_models("cuda", mixer=mixer)
    teacher = teacher if kd_weight else None
    generator = torch.Generator().manual_seed(3)
    data = packed_dataset(generator)
    data.tensors["answers"] = torch.rand(data.tensors["input_ids"].shape, generator=generator) < 0.05
    table = torch.rand(len(data), data.seq_len, generator=generator) if weighting == "table" else slow_position_weights
    config = dict(
        steps=8, batch_size=2, lr=3e-3, warmup_steps=2, schedule="constant", log_every=0, save_every=4,
        trainable="mixers+lora", mixed_precision="bf16", token_weight_tau=2000.0, kd_weight=kd_weight,
        answer_weight=4.0,
    )  # fmt: skip
    start = copy.deepcopy(hybrid)
    add_lora(start, TrainConfig(**config))  # the adapters train() adds, drawn from the same seed
    initial = {n: p.detach().clone() for n, p in start.named_parameters()}
    slots = run_document_slots(data, config["batch_size"], TrainConfig(**config).seed, config["steps"])
    runs = {}
    for run in ("eager", "eager-nudged", "graphed"):
        model = copy.deepcopy(hybrid)
        if run == "eager-nudged":  # starting weights 2^-20 apart, as one step rounded otherwise leaves them
            vector_to_parameters(parameters_to_vector(model.parameters()) * (1 + 2**-20), model.parameters())
        with monkeypatch.context() as eager_on_the_graph_layout:
            if run != "graphed":
                eager_on_the_graph_layout.setattr(chunked, "FORCE_DEVICE_CHOICE", True)
                eager_on_the_graph_layout.setattr(
                    stage2,
                    "device_documents",
                    lambda batch, device: tuple(t.to(device) for t in host_documents(batch, slots=slots)),
                )
            graphs = run == "graphed"
            history = train(model, teacher, data, config | {"cuda_graphs": graphs}, tmp_path / run, table)
        assert history[-1].get("graph_layouts", 0) == (1 if graphs else 0)  # every batch padded to the run's slots
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        runs[run] = ([r["loss"] for r in history], weights)
    (eager, eager_weights), (graphed, graphed_weights) = runs["eager"], runs["graphed"]
    nudged, nudged_weights = runs["eager-nudged"]
    assert_same_losses(graphed, eager, nudged)
    assert_same_updates(graphed_weights, eager_weights, initial, rounding=nudged_weights)

    resumed = copy.deepcopy(hybrid)
    first = train(resumed, teacher, data, config | {"cuda_graphs": True, "steps": 4}, tmp_path / "resumed", table)
    resumed = copy.deepcopy(hybrid)  # a fresh process: everything comes from the checkpoint
    second = train(resumed, teacher, data, config | {"cuda_graphs": True}, tmp_path / "resumed", table)
    assert_same_losses([r["loss"] for r in first + second], eager, nudged)
    resumed_weights = {n: p.detach() for n, p in resumed.named_parameters()}
    assert_same_updates(resumed_weights, eager_weights, initial, rounding=nudged_weights)
