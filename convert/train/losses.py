"""The losses of align and train, in one place.

- `alignment_mse`: stage 1's loss per converted layer, the mean squared error between a mixer's output and the
  teacher's attention output, over real tokens.
- `ce_loss`: stage 2's next-token cross-entropy, optionally weighted per token (token_weights.py), over the
  predictions `prediction_mask` counts (both tokens real and of one document).
- `kd_loss`: distillation, T^2 * KL(teacher || student) of the logits at temperature T.
- `aux_loss`: the model's own auxiliary loss (the mixers' balance losses, e.g. SSE's, already weighted and summed
  by the model; the loss itself is computed by the mixer, whose code an exported model carries).
- `mixers_aux_loss`: the same balance losses as align gets them, from the mixers it called one by one.
- `training_loss`: stage 2's total, CE + kd_weight * KD + aux.

Every mean over tokens is `masked_mean`: a sum over the tokens that count divided by their number (at least 1);
`ce_loss` and `kd_loss` instead weigh each token by 1 / that number inside `_RowLoss`, which works through the
[B * T, V] logits a chunk of rows at a time in float32 and computes their gradient in the same pass, instead of
keeping float32 copies of the logits for backward and running cross_entropy over a transposed [B, V, T] layout
(a slow softmax kernel; docs/lab/TRAINING_SPEED.md has the profile). On CUDA, all the rows of either loss are one
Triton kernel (kernels/loss: two reads of each row instead of the chunks' float32 passes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raven_kernels.loss import fused_cross_entropy, fused_distillation


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of `values` [B, T] over the entries where mask [B, T] is nonzero (all of them without a mask)."""
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def alignment_mse(output: torch.Tensor, target: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error between a mixer's output and the teacher's attention output [B, T, hidden], averaged
    over the hidden size and then over the real tokens (real [B, T], True or 1 at real tokens; None: all)."""
    return masked_mean((output.float() - target.float()).pow(2).mean(-1), real)


def prediction_mask(batch: dict) -> torch.Tensor:
    """[B, T]: 1 where position t makes a prediction that counts: t and t + 1 are real tokens of one document."""
    mask = batch["attention_mask"]
    keep = mask[:, :-1] * mask[:, 1:]
    if "document_ids" in batch:
        keep = keep * (batch["document_ids"][:, 1:] == batch["document_ids"][:, :-1])
    return F.pad(keep, (0, 1))


# rows of logits per chunk: ~2^27 float32 values (512 MiB) at a time, whatever the vocabulary
CHUNK_VALUES = 2**27


class _RowLoss(torch.autograd.Function):
    """sum_n scale[n] * f(row n) for logits [N, V], with its gradient computed in the same pass, chunk by chunk, and
    kept in the logits' dtype (what autograd would hand a bf16 head anyway): no float32 copy of the whole [N, V]
    logits is made or kept for backward. rows(start, stop, out) -> f of those rows [n] (float32); with `out` (the
    gradient's rows start:stop), it also writes scale[n] * df/dlogits there."""

    @staticmethod
    def forward(ctx, logits, scale, rows, chunk):
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None  # none under no_grad (validation)
        for start in range(0, logits.shape[0], chunk):
            stop = min(start + chunk, logits.shape[0])
            values = rows(start, stop, None if grad is None else grad[start:stop])
            total += (values * scale[start:stop]).sum()
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None


def _row_loss(logits, scale, rows, chunk: int | None = None) -> torch.Tensor:
    """_RowLoss on logits [N, V] in chunks of `chunk` rows (default: CHUNK_VALUES at a time); outside autograd
    (no_grad, or logits without grad) no gradient is computed."""
    chunk = chunk or max(1, CHUNK_VALUES // logits.shape[-1])
    if not (torch.is_grad_enabled() and logits.requires_grad):
        logits = logits.detach()
    return _RowLoss.apply(logits, scale, rows, chunk)


def fused_rows(*logits: torch.Tensor) -> bool:
    """Whether ce_loss and kd_loss take their Triton kernels (kernels/loss): CUDA logits with contiguous rows."""
    return all(x.is_cuda and x.stride(-1) == 1 for x in logits)


def answer_weighted(weights: torch.Tensor | None, answers: torch.Tensor, factor: float) -> torch.Tensor:
    """Token weights [B, T] (None: ones) times `factor` at the predictions of answer tokens: position t predicts
    token t + 1, so where answers[:, t + 1] (answers [B, T], nonzero at answer tokens)."""
    scale = 1 + (factor - 1) * F.pad(answers[:, 1:].float(), (0, 1))  # [B, T]
    return scale if weights is None else weights * scale


def ce_loss(logits, input_ids, mask, weights=None, fused: bool | None = None) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts input_ids[:, t + 1]; weights [B, T] scale position t's loss.
    mask [B, T] is 1 where position t's prediction counts (see prediction_mask). Averaged over those predictions
    (a weighted sum over their count when weights are given). logits [B, T, V]: float32 math, all rows in one
    Triton kernel (`fused`; default: `fused_rows`, the tests also run it interpreted on the CPU) or chunk by chunk
    in PyTorch."""
    batch, length, vocab = logits.shape
    counted = mask[:, :-1].float()  # [B, T-1]
    scale = counted if weights is None else counted * weights[:, :-1].float()
    scale = F.pad(scale / counted.sum().clamp(min=1), (0, 1)).reshape(-1).detach()  # [B*T]: the last predicts nothing
    targets = F.pad(input_ids[:, 1:], (0, 1)).reshape(-1)  # [B*T]
    flat = logits.reshape(batch * length, vocab)
    if fused if fused is not None else fused_rows(flat):

        def kernel_rows(start: int, stop: int, out: torch.Tensor | None):
            return fused_cross_entropy(flat[start:stop], targets[start:stop], scale[start:stop], out)

        return _row_loss(flat, scale, kernel_rows, chunk=flat.shape[0])

    def rows(start: int, stop: int, out: torch.Tensor | None):
        x = flat[start:stop].to(torch.float32, copy=True)  # [n, V], changed in place below
        picked = targets[start:stop, None]  # [n, 1]
        lse = torch.logsumexp(x, dim=-1)  # [n]
        values = lse - x.gather(1, picked).squeeze(1)
        if out is not None:
            d = x.sub_(lse[:, None]).exp_()  # softmax, in place of the copy
            d.scatter_add_(1, picked, torch.full_like(picked, -1, dtype=d.dtype))
            out.copy_(d.mul_(scale[start:stop, None]))
        return values

    return _row_loss(flat, scale, rows)


def kd_loss(student_logits, teacher_logits, temperature: float = 1.0, mask=None, fused: bool | None = None):
    """T^2 * KL(teacher || student) of softmax(logits / T), summed over the vocabulary and averaged over tokens
    (those with mask == 1 when given). Zero when the logits agree. float32 math, all rows in one Triton kernel
    (`fused`; default: `fused_rows`) or chunk by chunk in PyTorch; the gradient goes to the student only
    (T * (p_student - p_teacher) per token)."""
    batch, length, vocab = student_logits.shape
    counted = torch.ones(batch, length, device=student_logits.device) if mask is None else mask.float()
    scale = (counted / counted.sum().clamp(min=1) * temperature**2).reshape(-1).detach()  # [B*T]
    student = student_logits.reshape(batch * length, vocab)
    teacher = teacher_logits.detach().reshape(batch * length, vocab)
    if fused if fused is not None else fused_rows(student, teacher):

        def kernel_rows(start: int, stop: int, out: torch.Tensor | None):
            return fused_distillation(student[start:stop], teacher[start:stop], scale[start:stop], temperature, out)

        return _row_loss(student, scale, kernel_rows, chunk=student.shape[0])

    def rows(start: int, stop: int, out: torch.Tensor | None):
        log_s = F.log_softmax(student[start:stop].float() / temperature, dim=-1)  # [n, V]
        log_t = F.log_softmax(teacher[start:stop].float() / temperature, dim=-1)
        p_t = log_t.exp()
        values = torch.where(p_t > 0, p_t * (log_t - log_s), 0.0).sum(-1)  # [n]; 0 log 0 = 0 where ruled out
        if out is not None:  # d KL / d student logits, scaled
            out.copy_(log_s.exp_().sub_(p_t).mul_(scale[start:stop, None] / temperature))
        return values

    return _row_loss(student, scale, rows)


def aux_loss(outputs) -> torch.Tensor | None:
    """The model's auxiliary loss in float32 (`outputs.aux_loss`: the sum of its mixers' balance losses, already
    weighted), or None when it has none."""
    aux = getattr(outputs, "aux_loss", None)
    return None if aux is None else aux.float()


def mixers_aux_loss(hybrid, layers) -> torch.Tensor | None:
    """Align's share of the auxiliary loss: the balance losses (SSE's) the mixers of `layers` left in their last
    call, summed in float32; None when none of them has one."""
    aux = [hybrid.model.layers[i].self_attn.aux_loss for i in layers]
    aux = [a.float() for a in aux if a is not None]
    return torch.stack(aux).sum() if aux else None


def training_loss(parts: dict[str, torch.Tensor], kd_weight: float = 0.0) -> torch.Tensor:
    """Stage 2's loss from its parts {"ce", and "kd", "aux" where present}: CE + kd_weight * KD + aux."""
    return parts["ce"] + kd_weight * parts.get("kd", 0.0) + parts.get("aux", 0.0)
