"""Align's steps as CUDA graphs: padded document layouts change nothing, the setting is checked before a model
loads, and on a GPU (`python -m pytest -m gpu`) the graphed align computes what the eager one does."""

import copy
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.train.align import align, alignment_losses, step_inputs
from raven_convert.train.common import mixer_parameters
from raven_convert.train.graphs import pad_documents, resolve_graphs
from raven_convert.train.recipe import Recipe
from raven_layers.backend import use_backend
from raven_layers.modeling_hybrid import find_packed_documents
from tests.conftest import tiny_config

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


def sila_models(device="cpu"):
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama")).to(device).eval()
    return teacher, build_hybrid(teacher, plan_layers([("sila", "0,2")], 4), {}).to(device)


def test_pad_documents_adds_empty_documents_up_to_the_bucket():
    cu = torch.tensor([0, 5, 9, 40], dtype=torch.int32)
    padded = pad_documents(cu, 4)
    assert padded.tolist() == [0, 5, 9, 40, 40] and padded.dtype == torch.int32
    assert pad_documents(cu, 3).tolist() == cu.tolist()  # already a multiple
    assert pad_documents(cu, 64).shape == (65,)
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


def test_padded_documents_change_no_loss_or_gradient():
    """What a graph runs (offsets padded with empty documents) against what the eager step runs, through SILA's
    kernels (interpreted on the CPU) and its PyTorch form."""
    teacher, hybrid = sila_models()
    batch = packed_rows(2, 48, 9, torch.Generator().manual_seed(1))
    for backend in ("triton", "torch"):
        runs = []
        for bucket in (None, 32):
            hybrid.zero_grad(set_to_none=True)
            inputs, packed = step_inputs(batch, "cpu", bucket)
            with use_backend(backend):
                losses = alignment_losses(teacher, hybrid, **inputs, packed=packed)
                sum(losses.values()).backward()
            runs.append(([v.item() for v in losses.values()], [p.grad.clone() for p in mixer_parameters(hybrid)]))
        (plain, plain_grads), (padded, padded_grads) = runs
        assert padded == pytest.approx(plain, rel=1e-6), backend
        for a, b in zip(plain_grads, padded_grads):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_graphs_are_used_only_where_they_can_run():
    _, hybrid = sila_models()
    assert resolve_graphs(False, hybrid, "cuda") is False
    assert resolve_graphs("auto", hybrid, "cpu") is False
    with pytest.raises(ValueError, match="the device is cpu, not cuda"):
        resolve_graphs(True, hybrid, "cpu")
    with pytest.raises(ValueError, match="2 processes"):
        resolve_graphs(True, hybrid, "cuda", world=2)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    mixed = build_hybrid(teacher, plan_layers([("sila", "0"), ("sse", "2")], 4), {"sse": {"lora_rank": 8}})
    with pytest.raises(ValueError, match=r"\['SSEMixer'\] are not declared graph_safe"):
        resolve_graphs(True, mixed, "cuda")
    assert resolve_graphs("auto", mixed, "cuda") is False
    with pytest.raises(ValueError, match="expected 'auto', true or false"):
        resolve_graphs("yes", hybrid, "cuda")


def test_recipe_refuses_graphs_for_mixers_that_cannot_run_them():
    base = {"source": "m", "layers": [{"mixer": "raven", "layers": "0-3"}]}
    with pytest.raises(ValueError, match="align.cuda_graphs = true needs mixers declared graph_safe; raven is not"):
        Recipe.model_validate(base | {"align": {"cuda_graphs": True}})
    assert Recipe.model_validate(base | {"align": {"cuda_graphs": "auto"}}).align.cuda_graphs == "auto"
    sila = base | {"layers": [{"mixer": "sila", "layers": "0-3"}], "align": {"cuda_graphs": True}}
    assert Recipe.model_validate(sila).align.cuda_graphs is True


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
def test_graphed_align_matches_eager_on_cuda(compile, tmp_path):
    """Several document buckets (a warm-up step, a capture, then replays each), bf16 autocast as the recipes run,
    with and without the compiled parts; then a run stopped after a checkpoint and resumed with graphs."""
    teacher, hybrid = sila_models("cuda")
    generator = torch.Generator().manual_seed(2)
    batches = [packed_rows(2, 256, longest, generator) for longest in (64, 6, 64, 6, 64, 6, 40, 64, 6)]
    runs = {}
    for graphs in (False, True):
        model = copy.deepcopy(hybrid)
        settings = dict(steps=len(batches), lr=3e-3, warmup_steps=2, log_every=0, mixed_precision="bf16")
        history = align(teacher, model, iter(batches), compile=compile, cuda_graphs=graphs, **settings)
        runs[graphs] = ([r["loss"] for r in history], [p.detach().clone() for p in mixer_parameters(model)])
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
