"""Reference of `fused_cross_entropy`, in float32 PyTorch: each row's loss lse(x) - x[target] and the gradient
scale[n] * (softmax(x) - onehot(target))."""

import torch


def naive_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor):
    """logits [N, V], targets [N] (indices in [0, V)), scale [N] -> (loss per row [N], gradient [N, V]) in
    float32."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)  # [N]
    loss = lse - x.gather(1, targets[:, None].long()).squeeze(1)
    grad = torch.softmax(x, dim=-1)
    grad[torch.arange(x.shape[0], device=x.device), targets.long()] -= 1.0
    return loss, grad * scale.float()[:, None]
