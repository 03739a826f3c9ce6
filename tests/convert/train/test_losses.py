"""The losses of align and train (convert/train/losses.py): means over the tokens that count, exactly."""

import pytest
import torch
import torch.nn.functional as F

from raven_convert.train import losses
from raven_convert.train.losses import (
    alignment_mse,
    answer_weighted,
    aux_loss,
    ce_loss,
    kd_loss,
    masked_mean,
    prediction_mask,
    training_loss,
)


def test_masked_mean_counts_only_the_masked_entries():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert masked_mean(values) == values.mean()
    assert masked_mean(values, torch.tensor([[1, 0, 1], [0, 0, 1]])) == pytest.approx(10 / 3)
    assert masked_mean(values, torch.tensor([[True, False, False], [False, False, False]])) == 1.0
    assert masked_mean(values, torch.zeros(2, 3)) == 0.0  # nothing counts: 0, not nan


def test_alignment_mse_is_over_the_hidden_size_then_the_real_tokens():
    out, target = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    real = torch.tensor([[False, True, True, True], [True, True, True, True]])
    per_token = (out - target).pow(2).mean(-1)
    torch.testing.assert_close(alignment_mse(out, target), per_token.mean())
    torch.testing.assert_close(alignment_mse(out, target, real), per_token[real].mean())
    moved = out.clone()
    moved[0, 0] += 10  # a padded token does not count
    torch.testing.assert_close(alignment_mse(moved, target, real), alignment_mse(out, target, real))


def test_packed_documents_do_not_predict_across_boundaries():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
        "attention_mask": torch.ones(1, 5, dtype=torch.long),
        "document_ids": torch.tensor([[0, 0, 1, 1, 1]]),
        "position_ids": torch.tensor([[0, 1, 0, 1, 2]]),
    }
    assert prediction_mask(batch).tolist() == [[1, 0, 1, 1, 0]]  # token 1 ends a document; the last predicts nothing


def test_ce_is_the_next_token_loss_over_counted_predictions_weighted_per_token():
    logits, ids = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 0]])
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T - 1]
    counted = mask[:, :-1].bool()
    torch.testing.assert_close(ce_loss(logits, ids, mask), per_token[counted].mean())
    weights = torch.rand(2, 5) + 0.5
    weighted = (per_token * weights[:, :-1])[counted].sum() / counted.sum()  # a weighted sum over the count
    torch.testing.assert_close(ce_loss(logits, ids, mask, weights), weighted)


def test_answer_weights_fall_on_the_predictions_of_answer_tokens():
    answers = torch.tensor([[0, 0, 1, 1, 0], [1, 0, 0, 0, 1]])
    assert answer_weighted(None, answers, 5.0).tolist() == [[1, 5, 5, 1, 1], [1, 1, 1, 5, 1]]
    weights = torch.full((2, 5), 2.0)
    assert answer_weighted(weights, answers, 5.0).tolist() == [[2, 10, 10, 2, 2], [2, 2, 2, 10, 2]]


def test_kd_is_zero_for_equal_logits_and_positive_otherwise():
    logits = torch.randn(2, 5, 11)
    assert kd_loss(logits, logits.clone(), temperature=2.0).abs() < 1e-6
    assert kd_loss(logits, torch.randn(2, 5, 11), temperature=2.0) > 0
    mask = torch.ones(2, 5)
    mask[0, 1:] = 0
    other = logits.clone()
    other[0, 3] += 5  # a masked-out position does not count
    assert kd_loss(logits, other, 1.0, mask).abs() < 1e-6


def reference_ce(logits, ids, mask, weights=None):
    """The loss as plain autograd ops: cross-entropy of the float32 logits over the counted predictions."""
    per_token = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    if weights is not None:
        per_token = per_token * weights[:, :-1]
    counted = mask[:, :-1].float()
    return (per_token * counted).sum() / counted.sum()


def reference_kd(student, teacher, temperature, mask):
    log_s = F.log_softmax(student.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher.float() / temperature, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    return (kl * mask).sum() / mask.sum() * temperature**2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_values", [2**27, 3 * 11])  # one chunk; three rows per chunk (the last one short)
def test_chunked_losses_and_gradients_match_plain_autograd(monkeypatch, dtype, chunk_values):
    import raven_convert.train.losses as losses

    monkeypatch.setattr(losses, "CHUNK_VALUES", chunk_values)
    torch.manual_seed(0)
    shape = (2, 7, 11)
    logits = (3 * torch.randn(shape)).to(dtype).requires_grad_()
    teacher = (3 * torch.randn(shape)).to(dtype)
    ids = torch.randint(0, 11, shape[:2])
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1, 0]])
    weights = torch.rand(shape[:2]) + 0.5

    def total(ce, kd):  # as stage 2 combines them: scaled parts, kd_weight, a gradient that is not 1; kd on all
        return 3.0 * (0.7 * ce(logits, ids, mask, weights) + 0.5 * kd(logits, teacher, 2.0, torch.ones(shape[:2])))

    ours = total(ce_loss, kd_loss)
    (grad,) = torch.autograd.grad(ours, logits)
    expected = total(reference_ce, reference_kd)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(ours, expected)
    assert grad.dtype == dtype
    # bf16: the stored gradient is rounded once more than plain autograd's (then scaled by the total's gradient)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-3}
    torch.testing.assert_close(grad, expected_grad, **tolerance)
    (ce_grad,) = torch.autograd.grad(ce_loss(logits, ids, mask), logits)
    uncounted = ce_grad.float()[F.pad(mask[:, :-1], (0, 1)) == 0]  # predictions that do not count, and the last
    assert torch.equal(uncounted, torch.zeros_like(uncounted)) and ce_grad.abs().sum() > 0


def test_chunked_losses_keep_no_gradient_without_autograd():
    logits, ids = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    with torch.no_grad():
        loss = ce_loss(logits.requires_grad_(), ids, torch.ones(2, 5))
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference_ce(logits.detach(), ids, torch.ones(2, 5)))


def test_aux_and_the_total():
    class Out:
        aux_loss = torch.tensor(0.25, dtype=torch.bfloat16)

    assert aux_loss(object()) is None
    assert aux_loss(Out()).dtype == torch.float32
    ce, kd, aux = torch.tensor(2.0), torch.tensor(1.0), torch.tensor(0.25)
    assert training_loss({"ce": ce}) == 2.0
    assert training_loss({"ce": ce, "kd": kd, "aux": aux}, kd_weight=0.5) == 2.75


def test_ce_fused_kernel_matches_the_chunked_rows_in_value_and_gradient(monkeypatch):
    """ce_loss's Triton rows (CUDA; here interpreted) against its PyTorch rows, chunked as they run on a GPU: the
    loss and the gradient autograd hands the logits, weighted and masked, in float32 and bf16."""
    monkeypatch.setattr(losses, "CHUNK_VALUES", 3 * 40)  # three rows per chunk of the PyTorch form
    ids = torch.randint(0, 40, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 3:5] = 0
    weights = torch.rand(2, 9) + 0.5
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        logits = (3 * torch.randn(2, 9, 40)).to(dtype)
        runs = []
        for fused in (False, True):
            x = logits.clone().requires_grad_()
            loss = losses.ce_loss(x, ids, mask, weights, fused=fused)
            (2.0 * loss).backward()  # a scaled total, as the accumulating steps hand it
            runs.append((loss.detach(), x.grad.float()))
        (loss, grad), (fused_loss, fused_grad) = runs
        assert loss.isfinite() and grad.isfinite().all()
        torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused_grad, grad, rtol=tol, atol=tol * 1e-2)


def test_kd_fused_kernel_matches_the_chunked_rows_in_value_and_gradient(monkeypatch):
    """kd_loss's Triton rows (CUDA; here interpreted) against its PyTorch rows, chunked, masked, at a temperature."""
    monkeypatch.setattr(losses, "CHUNK_VALUES", 3 * 40)
    mask = torch.ones(2, 9)
    mask[1, :4] = 0
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        student, teacher = ((3 * torch.randn(2, 9, 40)).to(dtype) for _ in range(2))
        teacher[0, 2, :25] = float("-inf")  # a teacher that rules tokens out: finite on both paths
        runs = []
        for fused in (False, True):
            x = student.clone().requires_grad_()
            loss = losses.kd_loss(x, teacher, 2.0, mask, fused=fused)
            (2.0 * loss).backward()
            runs.append((loss.detach(), x.grad.float()))
        (loss, grad), (fused_loss, fused_grad) = runs
        assert loss.isfinite() and grad.isfinite().all()
        torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused_grad, grad, rtol=tol, atol=tol * 1e-2)
