"""Cross-entropy of rows of logits, loss and gradient in one kernel, one program per row:

    loss[n] = lse(x_n) - x_n[t_n],   grad[n] = scale[n] * (softmax(x_n) - onehot(t_n))   (in the logits' dtype)

The first pass over the row keeps a running maximum and sum of exponentials (float32) and reads x_n[t_n]; the
second writes the softmax less the one-hot, scaled. A row with scale 0 (a prediction that does not count) gets a
zero gradient without the second read. Stage 2's PyTorch form (raven_convert.train.losses) makes four passes or
more over a float32 copy of each chunk of rows.
"""

import torch
import triton
import triton.language as tl

BV = 4096  # logits per block of a row


@triton.jit
def cross_entropy_fwd_kernel(
    x, targets, scale, loss, grad, stride_x, stride_g, V, BV: tl.constexpr, GRAD: tl.constexpr
):
    i_n = tl.program_id(0).to(tl.int64)
    p_x = x + i_n * stride_x
    o_v = tl.arange(0, BV)
    b_m = tl.full([], float("-inf"), tl.float32)  # running maximum of the row
    b_s = tl.zeros([], tl.float32)  # running sum of exp(x - b_m)
    for i_v in range(0, tl.cdiv(V, BV)):
        o = i_v * BV + o_v
        b_x = tl.load(p_x + o, mask=o < V, other=float("-inf")).to(tl.float32)  # [BV]
        b_mn = tl.maximum(b_m, tl.max(b_x, 0))  # finite: every block holds at least one logit
        b_s = b_s * tl.exp(b_m - b_mn) + tl.sum(tl.exp(b_x - b_mn), 0)
        b_m = b_mn
    b_lse = b_m + tl.log(b_s)
    i_t = tl.load(targets + i_n).to(tl.int64)
    tl.store(loss + i_n, b_lse - tl.load(p_x + i_t).to(tl.float32))
    if GRAD:
        p_g = grad + i_n * stride_g
        b_w = tl.load(scale + i_n).to(tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o = i_v * BV + o_v
            if b_w == 0:
                b_g = tl.zeros([BV], tl.float32)
            else:
                b_x = tl.load(p_x + o, mask=o < V, other=float("-inf")).to(tl.float32)
                b_g = b_w * (tl.exp(b_x - b_lse) - tl.where(o == i_t, 1.0, 0.0))
            tl.store(p_g + o, b_g.to(grad.dtype.element_ty), mask=o < V)


def fused_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, grad: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's loss [N] (float32) for logits [N, V] (last dim contiguous) and targets [N] in [0, V); with `grad`
    (a tensor like logits), also scale [N] times the loss's gradient, written into it in the same launch."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [N, V] with contiguous rows, got shape {tuple(logits.shape)}")
    N, V = logits.shape
    if targets.shape != (N,) or scale.shape != (N,):
        raise ValueError(f"targets and scale must be [{N}], got {tuple(targets.shape)} and {tuple(scale.shape)}")
    if grad is not None and (grad.shape != logits.shape or grad.stride(-1) != 1):
        raise ValueError(f"grad must be [{N}, {V}] with contiguous rows, got shape {tuple(grad.shape)}")
    loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return loss
    g = grad if grad is not None else loss  # an unused pointer without GRAD
    stride_g = grad.stride(0) if grad is not None else 0
    cross_entropy_fwd_kernel[(N,)](
        logits, targets.contiguous(), scale.contiguous(), loss, g, logits.stride(0), stride_g, V,
        BV=min(BV, triton.next_power_of_2(V)), GRAD=grad is not None, num_warps=8,
    )  # fmt: skip
    return loss
