"""GPU timings of the SSE kernels beside fla's `chunk_gla`: `python -m raven_kernels.sse.benchmark` (needs CUDA; fla
optional). B=4, T=4096, H=16, c = d = 128, bf16 q/k/v, float32 log-gates, by default.

Prints the median forward and forward+backward times (triton.testing.do_bench after a warm-up) and the first-call
time of: fla's dense chunk_gla, this chunk_gla on the same inputs, SSE n4k1 with the shared partition through its
varlen and masking forms on these kernels (`sse_parallel`, regrouping included) and through chunk_gla alone on the
regrouped entries; the per-kernel CUDA time of one SSE forward+backward; one decoding step (B=64) against
sse_recurrent; and the forward+backward time under other warp counts.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import raven_kernels.sse
from raven_kernels.sse import chunk as chunk_module
from raven_kernels.sse import chunk_gla, fused_recurrent_sse
from raven_kernels.sse.naive import sse_recurrent
from raven_kernels.timing import kernel_times, time_call
from raven_layers.sse_forms import sse_parallel


def sse_inputs(B, T, H, c, d, N=4, dtype=torch.bfloat16, seed=0):
    """n{N}k1 with the shared partition, as SSEMixer builds them: entry 0 the routed partition, entry 1 shared."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.randint(0, N, (B, T, H, 1), device="cuda", generator=g)
    idx = torch.cat([idx, torch.full_like(idx, N)], dim=-1)  # [B, T, H, 2]
    q = torch.randn(B, T, H, 1, 2, c, device="cuda", generator=g) * c**-0.5
    k = torch.randn(B, T, H, 2, c, device="cuda", generator=g).softmax(-1)
    v = torch.randn(B, T, H, d, device="cuda", generator=g)
    log_g = F.logsigmoid(torch.randn(B, T, H, 1, c, device="cuda", generator=g) + 4).expand(B, T, H, 2, c) / 16
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)] + [log_g.contiguous().requires_grad_()]
    return leaves, idx, N + 1


def gla_inputs(B, T, H, D, dtype=torch.bfloat16):
    q, k = (torch.randn(B, T, H, D, device="cuda") * D**-0.5 for _ in range(2))
    v = torch.randn(B, T, H, D, device="cuda")
    g = F.logsigmoid(torch.randn(B, T, H, D, device="cuda") + 4) / 16
    return [x.to(dtype).requires_grad_() for x in (q, k, v)] + [g.requires_grad_()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--warps", default="8", help="other warp counts to try for the o, dqk and dv kernels")
    p.add_argument("--block-k", default="64,128", help="other key blocks to try for SSE's dqk kernel")
    p.add_argument("--fla-only", action="store_true", help="time fla's chunk_gla alone (its first call autotunes)")
    args = p.parse_args(argv)
    B, T, H, D = args.batch, args.seq_len, args.heads, args.dim
    rows = []

    def report(name, t):
        rows.append((name, t["first_s"], t["fwd_ms"], t["fwd_bwd_ms"]))
        first, fwd, both = rows[-1][1:]
        print(f"{name:44s} first {first:7.2f} s  fwd {fwd:7.3f} ms  fwd+bwd {both:7.3f} ms", flush=True)

    dense = gla_inputs(B, T, H, D)
    if args.fla_only:
        from fla.ops.gla import chunk_gla as fla_chunk_gla

        report("fla chunk_gla (dense)", time_call(lambda q, k, v, g: fla_chunk_gla(q, k, v, g, D**-0.5), dense))
        return
    report(
        "chunk_gla (dense)",
        time_call(lambda q, k, v, g: chunk_gla(q.unsqueeze(3), k, v, g, D**-0.5), dense),
    )
    leaves, idx, P = sse_inputs(B, T, H, D, D)
    for impl in ("varlen", "masking"):
        form = sse_parallel(impl, raven_kernels.sse)
        fn = lambda q, k, v, g, form=form: form(q, k, v, g, idx, P, D**-0.5)  # noqa: E731
        report(f"SSE n4k1+shared sse_{impl}", time_call(fn, leaves))

    # chunk_gla alone on the entries regrouped as sse_varlen does (its cu_seqlens and order)
    segment = (torch.arange(B * H, device="cuda").view(B, 1, H, 1) * P + idx).flatten()
    order = (segment * T + torch.arange(T, device="cuda").view(1, T, 1, 1).expand(B, T, H, 2).flatten()).argsort()
    cu = F.pad(torch.bincount(segment, minlength=B * H * P).cumsum(0), (1, 0))
    q, k, v, g = leaves
    packed = [
        q.detach().transpose(3, 4).reshape(-1, 1, D)[order][None, :, None].requires_grad_(),
        k.detach().reshape(-1, D)[order][None, :, None].requires_grad_(),
        v.detach().unsqueeze(3).expand(B, T, H, 2, D).reshape(-1, D)[order][None, :, None].requires_grad_(),
        g.detach().reshape(-1, D)[order][None, :, None].requires_grad_(),
    ]
    report(
        "chunk_gla on the regrouped SSE entries", time_call(lambda *a: chunk_gla(*a, D**-0.5, None, True, cu), packed)
    )

    varlen = sse_parallel("varlen", raven_kernels.sse)
    fn = lambda q, k, v, g: varlen(q, k, v, g, idx, P, D**-0.5)  # noqa: E731
    grad = torch.randn(B, T, H, 1, D, device="cuda", dtype=torch.bfloat16)
    kernels = kernel_times(lambda: fn(*leaves)[0].backward(grad))
    print(f"one SSE varlen forward+backward, per kernel (ms of {sum(r[0] for r in kernels):.2f} device ms):")
    for ms, count, name in kernels[:16]:
        print(f"  {ms:7.3f} x{count:<3.0f} {name[:90]}")
    print(flush=True)

    saved = chunk_module.LOW_PRECISION_STATES
    chunk_module.LOW_PRECISION_STATES = False
    report("SSE varlen, float32 per-chunk states", time_call(fn, leaves))
    chunk_module.LOW_PRECISION_STATES = saved

    for warps in (int(w) for w in args.warps.split(",")):
        for kernel in ("o", "dqk", "dv"):
            saved = dict(chunk_module.WARPS)
            chunk_module.WARPS[kernel] = warps
            report(f"SSE varlen, {kernel} kernel at {warps} warps", time_call(fn, leaves))
            chunk_module.WARPS.update(saved)
    for block in (int(b) for b in args.block_k.split(",")):
        saved = dict(chunk_module.BLOCK_K)
        chunk_module.BLOCK_K["dqk_gather"] = block
        report(f"SSE varlen, dqk kernel on {block} key channels", time_call(fn, leaves))
        chunk_module.BLOCK_K.update(saved)

    Bd = 64
    dec, idx_d, P = sse_inputs(Bd, 1, H, D, D, dtype=torch.float32)
    dec = [x.detach() for x in dec]
    state = torch.randn(Bd, H, P, D, D, device="cuda")
    o_ref, s_ref = sse_recurrent(*dec, idx_d, P, D**-0.5, state)
    o, s = fused_recurrent_sse(*dec, idx_d, P, D**-0.5, state.clone())
    err = max(((o - o_ref).norm() / o_ref.norm()).item(), ((s - s_ref).norm() / s_ref.norm()).item())
    ms_kernel = do_bench(lambda: fused_recurrent_sse(*dec, idx_d, P, D**-0.5, state), return_mode="median")
    ms_torch = do_bench(lambda: sse_recurrent(*dec, idx_d, P, D**-0.5, state), return_mode="median")
    print(
        f"decode B={Bd} H={H} c=d={D} n4k1+shared: fused_recurrent_sse {ms_kernel * 1e3:.1f} us, "
        f"sse_recurrent {ms_torch * 1e3:.1f} us, rel err {err:.1e}"
    )

    print(f"\nB={B} T={T} H={H} D={D} bf16 on {torch.cuda.get_device_name()}")
    print(f"{'':44s} {'first s':>8s} {'fwd ms':>8s} {'fwd+bwd ms':>11s}")
    for name, first, f, fb in rows:
        print(f"{name:44s} {first:8.2f} {f:8.3f} {fb:11.3f}")


if __name__ == "__main__":
    main()
