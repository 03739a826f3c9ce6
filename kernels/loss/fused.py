"""Stage 2's losses of rows of logits, loss and gradient in one kernel each, one program per row:

    cross-entropy  loss[n] = lse(x_n) - x_n[t_n]
                   grad[n] = scale[n] (softmax(x_n) - onehot(t_n))
    distillation   loss[n] = KL(p_t || p_s) = lse(s_n) - lse(t_n) + sum_v p_t (t_n - s_n),  s = x / T, t = y / T
                   grad[n] = scale[n] (p_s - p_t) / T                                      (d loss / d x)

The first pass over a row keeps running maxima and sums of exponentials in float32 (and, for distillation, the
teacher-weighted sum of t - s, rescaled with the teacher's maximum), which give the loss; the second writes the
gradient in the logits' dtype. A row with scale 0 (a prediction that does not count) gets a zero gradient without
the second read. Stage 2's PyTorch form (raven_convert.train.losses) makes four passes or more over a float32 copy
of each chunk of rows.
"""

import torch
import triton
import triton.language as tl

BV = 4096  # logits per block of a row


@triton.jit
def running_max(b_m, b_x):
    """A row's running maximum after block b_x [BV], the factor exp(old - new) that rescales what was summed
    against the old one (0 while the old is -inf: nothing was), and the reference the block's exponentials take:
    the maximum, or 0 while every logit so far is -inf (a teacher that rules a whole block out), so that no
    exponent is -inf - (-inf)."""
    b_new = tl.maximum(b_m, tl.max(b_x, 0))
    b_r = tl.where(b_m == float("-inf"), 0.0, tl.exp(b_m - b_new))
    return b_new, b_r, tl.where(b_new == float("-inf"), 0.0, b_new)


@triton.jit
def cross_entropy_fwd_kernel(
    x, targets, scale, loss, grad, stride_x, stride_g, V, BV: tl.constexpr, GRAD: tl.constexpr
):
    i_n = tl.program_id(0).to(tl.int64)
    p_x = x + i_n * stride_x
    o_v = tl.arange(0, BV)
    b_m = tl.full([], float("-inf"), tl.float32)  # running maximum of the row
    b_s = tl.zeros([], tl.float32)  # running sum of exp(x - b_ref)
    b_ref = tl.zeros([], tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o = i_v * BV + o_v
        b_x = tl.load(p_x + o, mask=o < V, other=float("-inf")).to(tl.float32)  # [BV]
        b_m, b_r, b_ref = running_max(b_m, b_x)
        b_s = b_s * b_r + tl.sum(tl.exp(b_x - b_ref), 0)
    b_lse = b_ref + tl.log(b_s)
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


@triton.jit
def distillation_fwd_kernel(
    x, y, scale, loss, grad, stride_x, stride_y, stride_g, V, inv_t, BV: tl.constexpr, GRAD: tl.constexpr
):
    i_n = tl.program_id(0).to(tl.int64)
    p_x, p_y = x + i_n * stride_x, y + i_n * stride_y
    o_v = tl.arange(0, BV)
    b_ms, b_mt = tl.full([], float("-inf"), tl.float32), tl.full([], float("-inf"), tl.float32)  # running maxima
    b_ss, b_st = tl.zeros([], tl.float32), tl.zeros([], tl.float32)  # running sums of exp(s - ref), exp(t - ref)
    b_a = tl.zeros([], tl.float32)  # running sum of exp(t - ref) (t - s)
    b_rs, b_rt = tl.zeros([], tl.float32), tl.zeros([], tl.float32)  # the references
    for i_v in range(0, tl.cdiv(V, BV)):
        o = i_v * BV + o_v
        b_s = tl.load(p_x + o, mask=o < V, other=float("-inf")).to(tl.float32) * inv_t  # [BV]
        b_t = tl.load(p_y + o, mask=o < V, other=float("-inf")).to(tl.float32) * inv_t
        b_ms, b_r, b_rs = running_max(b_ms, b_s)
        b_ss = b_ss * b_r + tl.sum(tl.exp(b_s - b_rs), 0)
        b_mt, b_r, b_rt = running_max(b_mt, b_t)
        b_e = tl.exp(b_t - b_rt)  # 0 where the teacher's logit is -inf (padding lanes too): no 0 * inf below
        b_st = b_st * b_r + tl.sum(b_e, 0)
        b_a = b_a * b_r + tl.sum(tl.where(b_e > 0, b_e * (b_t - b_s), 0.0), 0)
    b_lse_s, b_lse_t = b_rs + tl.log(b_ss), b_rt + tl.log(b_st)
    tl.store(loss + i_n, b_lse_s - b_lse_t + b_a / b_st)
    if GRAD:
        p_g = grad + i_n * stride_g
        b_w = tl.load(scale + i_n).to(tl.float32) * inv_t
        for i_v in range(0, tl.cdiv(V, BV)):
            o = i_v * BV + o_v
            if b_w == 0:
                b_g = tl.zeros([BV], tl.float32)
            else:
                b_s = tl.load(p_x + o, mask=o < V, other=float("-inf")).to(tl.float32) * inv_t
                b_t = tl.load(p_y + o, mask=o < V, other=float("-inf")).to(tl.float32) * inv_t
                b_g = b_w * (tl.exp(b_s - b_lse_s) - tl.exp(b_t - b_lse_t))
            tl.store(p_g + o, b_g.to(grad.dtype.element_ty), mask=o < V)


def _check_rows(name: str, x: torch.Tensor, shape: tuple | None = None) -> None:
    """x must be [N, V] (`shape` when given) with contiguous rows, as the kernels read and write it."""
    if x.dim() != 2 or x.stride(-1) != 1 or (shape is not None and tuple(x.shape) != shape):
        want = f"[{shape[0]}, {shape[1]}]" if shape is not None else "[N, V]"
        raise ValueError(f"{name} must be {want} with contiguous rows, got shape {tuple(x.shape)}")


def _check_per_row(N: int, **tensors: torch.Tensor) -> None:
    for name, x in tensors.items():
        if tuple(x.shape) != (N,):
            raise ValueError(f"{name} must be [{N}] (one per row of the logits), got {tuple(x.shape)}")


def fused_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, grad: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's cross-entropy [N] (float32) for logits [N, V] and targets [N] in [0, V); with `grad` (a tensor
    like logits), also scale [N] times its gradient, written there in the same launch."""
    _check_rows("logits", logits)
    N, V = logits.shape
    _check_per_row(N, targets=targets, scale=scale)
    if grad is not None:
        _check_rows("grad", grad, (N, V))
    loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N:
        cross_entropy_fwd_kernel[(N,)](
            logits, targets.contiguous(), scale.contiguous(), loss, loss if grad is None else grad, logits.stride(0),
            0 if grad is None else grad.stride(0), V, BV=min(BV, triton.next_power_of_2(V)), GRAD=grad is not None,
            num_warps=8,
        )  # fmt: skip
    return loss


def fused_distillation(
    student: torch.Tensor,
    teacher: torch.Tensor,
    scale: torch.Tensor,
    temperature: float = 1.0,
    grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's KL(softmax(teacher / T) || softmax(student / T)) [N] (float32) for logits [N, V] each; with `grad`
    (a tensor like student), also scale [N] times its gradient in the student's logits, written there."""
    _check_rows("student", student)
    N, V = student.shape
    _check_rows("teacher", teacher, (N, V))
    _check_per_row(N, scale=scale)
    if grad is not None:
        _check_rows("grad", grad, (N, V))
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    loss = torch.empty(N, dtype=torch.float32, device=student.device)
    if N:
        distillation_fwd_kernel[(N,)](
            student, teacher, scale.contiguous(), loss, loss if grad is None else grad, student.stride(0),
            teacher.stride(0), 0 if grad is None else grad.stride(0), V, 1.0 / temperature,
            BV=min(BV, triton.next_power_of_2(V)), GRAD=grad is not None, num_warps=8,
        )  # fmt: skip
    return loss
