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

Every mean over tokens is `masked_mean`: a sum over the tokens that count divided by their number (at least 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def ce_loss(logits, input_ids, mask, weights=None) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts input_ids[:, t + 1]; weights [B, T] scale position t's loss.
    mask [B, T] is 1 where position t's prediction counts (see prediction_mask). Averaged over those predictions
    (a weighted sum over their count when weights are given)."""
    ce = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:], reduction="none")  # [B, T-1]
    if weights is not None:
        ce = ce * weights[:, :-1].to(ce)
    return masked_mean(ce, mask[:, :-1])


def kd_loss(student_logits, teacher_logits, temperature: float = 1.0, mask=None) -> torch.Tensor:
    """T^2 * KL(teacher || student) of softmax(logits / T), summed over the vocabulary and averaged over tokens
    (those with mask == 1 when given). Zero when the logits agree."""
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # [B, T]
    return masked_mean(kl, mask) * temperature**2


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
