"""References of the loss kernels, in float32 PyTorch: (loss per row [N], gradient [N, V]), the gradient scaled by
scale [N]."""

import torch
import torch.nn.functional as F


def naive_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor):
    """lse(x) - x[target] per row, and scale[n] * (softmax(x) - onehot(target)); targets [N] in [0, V)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)  # [N]
    loss = lse - x.gather(1, targets[:, None].long()).squeeze(1)
    grad = torch.softmax(x, dim=-1)
    grad[torch.arange(x.shape[0], device=x.device), targets.long()] -= 1.0
    return loss, grad * scale.float()[:, None]


def naive_distillation(student: torch.Tensor, teacher: torch.Tensor, scale: torch.Tensor, temperature: float = 1.0):
    """KL(softmax(teacher / T) || softmax(student / T)) per row, and scale[n] * (p_student - p_teacher) / T."""
    log_s = F.log_softmax(student.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher.float() / temperature, dim=-1)
    p_t = log_t.exp()
    loss = torch.where(p_t > 0, p_t * (log_t - log_s), 0.0).sum(-1)  # 0 log 0 = 0 where the teacher rules out
    return loss, (log_s.exp() - log_t.exp()) * (scale.float()[:, None] / temperature)
