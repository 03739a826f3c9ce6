"""Stage 2's losses over rows of logits, each in one Triton kernel; naive.py holds the PyTorch references they are
tested against. Both compute each row's loss and, in the same launch, its scaled gradient in the logits' dtype:
no float32 copy of the [N, V] logits is made.

- `fused_cross_entropy`: next-token cross-entropy, from two reads of the row (an online log-sum-exp, then the
  softmax written out);
- `fused_distillation`: KL(teacher || student) of the logits at a temperature, from two reads of both rows (online
  log-sum-exps and the teacher-weighted difference, then both softmaxes).
"""

from .fused import fused_cross_entropy, fused_distillation

__all__ = ["fused_cross_entropy", "fused_distillation"]
