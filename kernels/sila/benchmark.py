"""GPU timings of `fused_recurrent_sila` beside fla's peers (needs CUDA; fla unless --without-fla):

    python -m raven_kernels.sila.benchmark [--dims 128] [--sweep-warps 4 16] [--chunk-warps 4] [--without-fla]

Prints, per head dim, the median forward and forward+backward times (triton.testing.do_bench after a warm-up),
the first-call time, the share of each kernel, and one decoding step.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from raven_kernels.sila import fused_recurrent_sila, utils
from raven_kernels.timing import time_call


def sila_inputs(B, T, H, d, G=1, dtype=torch.bfloat16):
    dev = "cuda"
    q = F.normalize(torch.randn(B, T, H, G, d, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, d, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, H, d, device=dev).to(dtype)
    alpha = torch.rand(B, T, H, G, device=dev)
    beta_x, gamma_x = torch.randn(B, T, H, device=dev), torch.randn(B, T, H, device=dev) - 1
    w_beta, w_gamma = 0.1 * torch.randn(H, d, device=dev), 0.1 * torch.randn(H, d, device=dev)
    return [x.requires_grad_() for x in (q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma)]


def fla_inputs(B, T, H, d, dtype=torch.bfloat16):
    q, k = (F.normalize(torch.randn(B, T, H, d, device="cuda"), dim=-1).to(dtype) for _ in range(2))
    v = torch.randn(B, T, H, d, device="cuda", dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, d, device="cuda")) / 16
    beta = torch.rand(B, T, H, device="cuda", dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def row(name, t):
    return name, t["fwd_ms"], t["fwd_bwd_ms"], f"{t['first_s']:.1f} s"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--sweep-warps", type=int, nargs="*", default=[], help="also time the sequential kernels so")
    parser.add_argument("--chunk-warps", type=int, nargs="*", default=[], help="also time the chunk kernels so")
    parser.add_argument("--without-fla", action="store_true", help="time no fla peer (chunk_gla compiles ~5 min)")
    args = parser.parse_args()
    B, T, H = args.batch, args.length, args.heads

    rows = []
    for d in args.dims:  # SILA first: a run cut short by the peers' compilation still has these
        x = sila_inputs(B, T, H, d)
        t = time_call(fused_recurrent_sila, x, profile=True)
        rows.append(row(f"sila fused_recurrent d={d}", t))
        print(rows[-1], f"peak memory {t['peak_mib'] / 1024:.2f} GiB (on top of the inputs)", flush=True)
        shares = ", ".join(f"{name} {ms:.2f}" for ms, _, name in t["kernels"] if "sila" in name)
        print(f"d={d} kernels (ms):", shares, flush=True)
        default = utils.launch_settings
        for kind, choices in (("sweep", args.sweep_warps), ("chunk", args.chunk_warps)):
            for warps in choices:
                utils.launch_settings = lambda K, V, kind=kind, w=warps, base=default: {**base(K, V), kind: w}
                t = time_call(fused_recurrent_sila, x, profile=True)
                rows.append(row(f"sila {kind} num_warps={warps} d={d}", t))
                shares = ", ".join(f"{name} {ms:.2f}" for ms, _, name in t["kernels"] if "sila" in name)
                print(rows[-1], "kernels (ms):", shares, flush=True)
                utils.launch_settings = default
    step = [x.detach() for x in sila_inputs(64, 1, H, 128)]
    state = torch.randn(64, H, 128, 128, device="cuda")
    decode = do_bench(lambda: fused_recurrent_sila(*step, state, output_final_state=True), return_mode="median")
    print(f"sila decode step B=64 H={H} d=128: {decode * 1e3:.1f} us", flush=True)
    for d in [] if args.without_fla else args.dims:
        from fla.ops.delta_rule import fused_recurrent_delta_rule
        from fla.ops.gla import chunk_gla

        q, k, v, g, beta = fla_inputs(B, T, H, d)
        rows.append(row(f"fla chunk_gla d={d}", time_call(lambda *a: chunk_gla(*a), (q, k, v, g))))
        print(rows[-1], flush=True)
        rows.append(
            row(f"fla fused_recurrent_delta_rule d={d}", time_call(fused_recurrent_delta_rule, (q, k, v, beta)))
        )
        print(rows[-1], flush=True)

    print(f"\nB={B} T={T} H={H}, bf16, median ms ({torch.cuda.get_device_name()})")
    print(f"{'kernel':42s} {'forward':>9s} {'fwd+bwd':>9s} {'first call':>11s}")
    for name, f, fb, first in rows:
        print(f"{name:42s} {f:9.3f} {fb:9.3f} {first:>11s}")
    print(f"{f'sila decode step B=64 H={H} d=128':42s} {decode * 1e3:8.1f} us")


if __name__ == "__main__":
    main()
