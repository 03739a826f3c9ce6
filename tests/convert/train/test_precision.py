"""Frozen linear weights in bf16 while a stage runs: the same numbers as autocast's casts, the float32 weights back
afterwards; align and stage 2 give bit-identical results with and without it."""

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.train import align as align_module
from raven_convert.train import stage2
from raven_convert.train.align import align
from raven_convert.train.common import mixer_parameters
from raven_convert.train.data import PackedDataset
from raven_convert.train.precision import frozen_linears_in
from raven_convert.train.stage2_config import TrainConfig

SETTINGS = {"raven": {"num_slots": 16, "top_k": 4}, "sse": {"lora_rank": 8}, "sila": {}}


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.fixture(params=["llama", "qwen2"])  # qwen2: tied embeddings, whose weight must stay float32
def teacher(request, tiny_sources):
    return AutoModelForCausalLM.from_pretrained(tiny_sources[request.param]).eval().requires_grad_(False)


def hybrid(teacher):
    kinds = plan_layers([("raven", "0"), ("sse", "1"), ("sila", "2")], 4)
    return build_hybrid(teacher, kinds, SETTINGS)


def test_swapped_weights_give_autocasts_numbers_and_come_back(teacher):
    ids = torch.randint(3, 100, (2, 17))
    with torch.no_grad(), autocast():
        expected = teacher(ids).logits
    originals = {n: p for n, p in teacher.named_parameters()}
    tied = teacher.config.tie_word_embeddings
    with frozen_linears_in([teacher, None], torch.bfloat16) as swapped:
        dtypes = {n: p.dtype for n, p in teacher.named_parameters()}
        with torch.no_grad(), autocast():
            got = teacher(ids).logits
    assert torch.equal(got, expected)
    linear = {  # weights and biases (qwen2's q, k, v)
        f"{n}.{t}"
        for n, m in teacher.named_modules()
        if isinstance(m, torch.nn.Linear)
        for t, p in m.named_parameters(recurse=False)
    }
    assert swapped == len(linear) - tied  # a tied head shares the embedding's weight: left float32
    assert {n for n, d in dtypes.items() if d == torch.bfloat16} == linear - ({"lm_head.weight"} if tied else set())
    assert dtypes["model.embed_tokens.weight"] == torch.float32 and dtypes["model.norm.weight"] == torch.float32
    assert all(p is originals[n] for n, p in teacher.named_parameters())  # the very same float32 tensors back


def test_trainable_weights_and_disabled_calls_are_left_alone(teacher):
    student = hybrid(teacher)
    mixers = {id(p) for p in mixer_parameters(student)}
    for p in student.parameters():
        p.requires_grad_(id(p) in mixers)
    with frozen_linears_in([student], torch.bfloat16):
        assert all(p.dtype == torch.float32 for p in mixer_parameters(student))
        assert student.model.layers[3].mlp.up_proj.weight.dtype == torch.bfloat16
    with frozen_linears_in([student], torch.bfloat16, enabled=False) as swapped:
        assert swapped == 0 and all(p.dtype == torch.float32 for p in student.parameters())


def test_weights_come_back_when_the_block_raises(teacher):
    with pytest.raises(RuntimeError, match="stop"), frozen_linears_in([teacher], torch.bfloat16):
        raise RuntimeError("stop")
    assert all(p.dtype == torch.float32 for p in teacher.parameters())


@contextlib.contextmanager
def no_swap(models, dtype, enabled=True):
    yield 0


def count_swaps(module, monkeypatch) -> list[int]:
    """Have `module`'s frozen_linears_in record how many tensors each use swapped."""
    counts = []

    @contextlib.contextmanager
    def counted(models, dtype, enabled=True):
        with frozen_linears_in(models, dtype, enabled) as swapped:
            counts.append(swapped)
            yield swapped

    monkeypatch.setattr(module, "frozen_linears_in", counted)
    return counts


def packed_rows(n: int = 8, T: int = 16) -> PackedDataset:
    ids = torch.randint(3, 100, (n, T), generator=torch.Generator().manual_seed(0)).int()
    return PackedDataset(
        {"input_ids": ids, "document_ids": torch.zeros_like(ids), "position_ids": torch.arange(T).expand(n, T).int()}
    )


def test_align_is_bit_identical_with_the_swap_and_one_logit(teacher, monkeypatch):
    def run():
        student = hybrid(teacher)
        batches = [
            {"input_ids": torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(s))} for s in range(3)
        ]
        history = align(teacher, student, iter(batches), steps=3, lr=3e-3, mixed_precision="bf16", log_every=0, seed=0)
        return [r["loss"] for r in history], [p.detach().clone() for p in mixer_parameters(student)]

    counts = count_swaps(align_module, monkeypatch)
    fast = run()
    assert counts[0] > 0
    monkeypatch.setattr(align_module, "frozen_linears_in", no_swap)
    monkeypatch.setattr(align_module, "_one_logit", lambda teacher: {})
    plain = run()
    assert fast[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(fast[1], plain[1]))


def test_stage2_is_bit_identical_with_the_swap(teacher, tmp_path, monkeypatch):
    def run(out):
        student = hybrid(teacher)
        config = TrainConfig(
            steps=2, batch_size=4, trainable="mixers+lora", kd_weight=1.0, mixed_precision="bf16", log_every=0
        )
        history = stage2.train(student, teacher, packed_rows(), config, out)
        trained = [p.detach().clone() for p in student.parameters() if p.requires_grad]
        return [(r["ce"], r["kd"]) for r in history], trained, student

    counts = count_swaps(stage2, monkeypatch)
    fast = run(tmp_path / "fast")
    assert counts[0] > 0  # the teacher's and the student's frozen linear weights were swapped
    assert all(p.dtype == torch.float32 for p in fast[2].parameters())  # saved and exported as it was
    monkeypatch.setattr(stage2, "frozen_linears_in", no_swap)
    plain = run(tmp_path / "plain")
    assert fast[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(fast[1], plain[1]))
