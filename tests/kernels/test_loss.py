"""The fused cross-entropy kernel against its float32 reference: per-row losses and scaled gradients, vocabularies
not a multiple of the block, rows that do not count, bf16 logits. On CPU the kernel runs in the Triton
interpreter."""

import pytest
import torch

from raven_kernels.loss import fused, fused_cross_entropy, fused_distillation
from raven_kernels.loss.naive import naive_cross_entropy, naive_distillation

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("V", "block", "dtype"),
    # one block, several with a partial last one, and the bf16 logits (gradient in bf16) training hands over
    [(50, None, torch.float32), (300, 128, torch.float32), (300, 128, torch.bfloat16)],
)
def test_rows_match_the_reference(V, block, dtype, monkeypatch):
    if block:
        monkeypatch.setattr(fused, "BV", block)
    g = torch.Generator().manual_seed(V)
    logits = (4 * torch.randn(7, V, generator=g)).to(DEVICE, dtype)
    targets = torch.randint(0, V, (7,), generator=g).to(DEVICE)
    targets[0], targets[1] = 0, V - 1  # the first and last logit of a row
    scale = torch.rand(7, generator=g).to(DEVICE)
    scale[2] = 0.0  # a prediction that does not count: a zero gradient row
    grad = torch.full_like(logits, float("nan"))
    loss = fused_cross_entropy(logits, targets, scale, grad)
    loss_ref, grad_ref = naive_cross_entropy(logits, targets, scale)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), grad_ref, **tol)
    assert grad[2].eq(0).all()
    torch.testing.assert_close(fused_cross_entropy(logits, targets, scale), loss)  # without a gradient


def test_bad_shapes_are_refused_with_their_sizes():
    logits = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"targets must be \[3\]"):
        fused_cross_entropy(logits, torch.zeros(4, dtype=torch.long), torch.ones(3))
    with pytest.raises(ValueError, match="contiguous rows"):
        fused_cross_entropy(logits.t(), torch.zeros(8, dtype=torch.long), torch.ones(8))
    with pytest.raises(ValueError, match=r"teacher must be \[3, 8\]"):
        fused_distillation(logits, torch.zeros(3, 9), torch.ones(3))
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        fused_distillation(logits, logits, torch.ones(3), temperature=0)


@pytest.mark.parametrize(
    ("V", "block", "dtype", "temperature"),
    [(50, None, torch.float32, 1.0), (300, 128, torch.float32, 2.0), (300, 128, torch.bfloat16, 1.0)],
)
def test_distillation_rows_match_the_reference(V, block, dtype, temperature, monkeypatch):
    if block:
        monkeypatch.setattr(fused, "BV", block)
    g = torch.Generator().manual_seed(V)
    student = (4 * torch.randn(6, V, generator=g)).to(DEVICE, dtype)
    teacher = (4 * torch.randn(6, V, generator=g)).to(DEVICE, dtype)
    teacher[1] = student[1]  # equal rows: KL 0, gradient 0
    teacher[3, : V // 2] = float("-inf")  # a teacher that rules tokens out (whole blocks): no nan from 0 * inf
    teacher[3] -= 200.0  # and far below 0: the exponentials' reference is the maximum, not 0, once there is one
    scale = torch.rand(6, generator=g).to(DEVICE)
    scale[2] = 0.0
    grad = torch.full_like(student, float("nan"))
    loss = fused_distillation(student, teacher, scale, temperature, grad)
    loss_ref, grad_ref = naive_distillation(student, teacher, scale, temperature)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad.float(), grad_ref, **tol)
    assert loss[1].abs() < 1e-5 and grad[2].eq(0).all()
    torch.testing.assert_close(fused_distillation(student, teacher, scale, temperature), loss)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("loss", ["cross_entropy", "distillation"])
def test_rows_match_the_reference_at_smollm2_size_on_cuda(loss):
    # SmolLM2's vocabulary (49,152: twelve blocks), bf16 logits of a quarter of a train step's rows
    g = torch.Generator(device="cuda").manual_seed(0)
    logits, other = ((4 * torch.randn(4096, 49152, device="cuda", generator=g)).bfloat16() for _ in range(2))
    targets = torch.randint(0, 49152, (4096,), device="cuda", generator=g)
    scale = torch.rand(4096, device="cuda", generator=g) / 4096
    grad = torch.empty_like(logits)
    if loss == "cross_entropy":
        values = fused_cross_entropy(logits, targets, scale, grad)
        values_ref, grad_ref = naive_cross_entropy(logits, targets, scale)
    else:
        values = fused_distillation(logits, other, scale, 2.0, grad)
        values_ref, grad_ref = naive_distillation(logits, other, scale, 2.0)
    torch.testing.assert_close(values, values_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad.float(), grad_ref, rtol=2e-2, atol=1e-9)
