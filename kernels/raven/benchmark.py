"""Time chunk_raven at the target shapes: forward, forward+backward, per-kernel times, first call, peak memory,
and the share of (chunk, slot block) pairs on the exact in-chunk path. Launch variants override launch_config
("a+b" both); "level0", "level1" time chunk_raven's other checkpoint levels (what the backward recomputes).

    python3 -m raven_kernels.raven.benchmark [--variants o8+dq8,level0,...] [--shapes 4x4096x256x32]

`--topk` times the router's top-K instead: `topk_slots` against `torch.topk` on [B, T, H_kv, M] float32 logits
(the prefill shapes of SmolLM2, H_kv = 3, and of the kernel shapes above).
"""

import argparse

import torch
import torch.nn.functional as F

from raven_kernels.chunked import RANGE_NATS
from raven_kernels.raven import chunk as raven_chunk
from raven_kernels.raven import chunk_raven, topk_slots
from raven_kernels.timing import time_training

H, D = 16, 128
SHAPES = [(4, 4096, 256, 32), (1, 32768, 64, 8)]  # B, T, M, K
VARIANTS = {  # (slots per block, warps, stages) of some per-chunk kernels, the others as launch_config has them
    "st1": {"o": (32, 4, 1), "dq": (16, 4, 1), "dkv": (32, 8, 1), "dlf": (32, 4, 1)},
    "dlf64": {"dlf": (64, 8, 1)},
    "dlf8": {"dlf": (32, 8, 1)},
    "dq8": {"dq": (16, 8, 3)},
    "dq4s2": {"dq": (16, 4, 2)},
    "o8": {"o": (32, 8, 3)},
    "o16": {"o": (16, 4, 3)},
    "dkv16": {"dkv": (16, 8, 3)},
}
SCAN_VARIANTS = {  # (steps, slots, head-dim columns, warps) of the long-sequence state scan (kernels/chunked.py)
    "scan-p2": lambda M, D: (2, 4, 64, 4),
    "scan-p4w2": lambda M, D: (4, 4, 64, 2),
    "scan-p4m8": lambda M, D: (4, 8, 64, 4),
    "scan-p8": lambda M, D: (8, 4, 64, 4),
    "scan-p8w2": lambda M, D: (8, 4, 64, 2),
}


def inputs(B, T, M, K):
    """As scripts/bench/bench_kernels.py: a = -4 softplus(randn), r = normalised sigmoid of the top-K router logits."""
    torch.manual_seed(0)
    q = torch.randn(B, T, H, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    a = (-F.softplus(torch.randn(B, T, H, device="cuda")) * 4.0).requires_grad_()
    top, idx = torch.randn(B, T, H, M, device="cuda").sigmoid().topk(K, dim=-1)
    r = (top / top.sum(-1, keepdim=True)).requires_grad_()
    return q, k, v, a, idx, r


def exact_share(a, idx, r, M, BM=32, BT=raven_chunk.BT, RANGE=RANGE_NATS):
    """Share of (chunk, head, slot block) whose in-chunk decay exceeds RANGE (they take the exact path; any at all
    compiles the kernels with the exact forms)."""
    B, T, Hh, K = idx.shape
    log_f = torch.zeros(B, T, Hh, M, device=a.device).scatter(-1, idx, a.detach()[..., None] * r.detach())
    tot = F.pad(log_f, (0, 0, 0, 0, 0, (-T) % BT)).view(B, -1, BT, Hh, M).sum(2)  # [B, NC, H, M]
    return (tot.view(B, -1, Hh, M // min(BM, M), min(BM, M)).amin(-1) < -RANGE).float().mean().item()


LEVELS = {"level0": 0, "level1": 1}


def case(B, T, M, K, variant, show_profile):
    level = LEVELS.get(variant, 2)
    if variant in SCAN_VARIANTS:
        raven_chunk.scan_config = SCAN_VARIANTS[variant]
    elif variant and variant not in LEVELS:  # launch variants, "+" combines them
        default = raven_chunk.launch_config
        over = {kernel: cfg for part in variant.split("+") for kernel, cfg in VARIANTS[part].items()}
        raven_chunk.launch_config = lambda D: {**default(D), **over}
    q, k, v, a, idx, r = inputs(B, T, M, K)

    def run():
        return chunk_raven(q, k, v, a, idx, r, D**-0.5, M, checkpoint_level=level)[0]

    t = time_training(run, [q, k, v, a, r], profile=show_profile or variant in LEVELS)
    t_f, t_fb = t["fwd_ms"], t["fwd_bwd_ms"]
    name = f"M={M} top-{K} B={B} T={T} [{variant or 'default'}]"
    print(
        f"{name:44s} fwd {t_f:7.2f} ms  fwd+bwd {t_fb:7.2f} ms  first call {t['first_s']:5.1f} s  "
        f"peak {t['peak_mib'] / 1024:5.2f} GiB  exact-path share {exact_share(a, idx, r, M):.3f}",
        flush=True,
    )
    rows = t.get("kernels", [])
    for ms, n, key in rows[:24]:
        print(f"    {ms:7.3f} ms  x{n:<4g} {key[:60]}", flush=True)
    if rows:
        print(f"    {sum(r[0] for r in rows):7.3f} ms  on the GPU in all ({len(rows)} kernels)", flush=True)
    return name, t_f, t_fb


def time_topk(shapes) -> None:
    """topk_slots against torch.topk (values and indices, as route() used it) on float32 router logits."""
    from triton.testing import do_bench

    print("| logits [B, T, H_kv, M], K | torch.topk ms | topk_slots ms | speed-up |\n| --- | --- | --- | --- |")
    for B, T, Hkv, M, K in shapes:
        logits = torch.randn(B, T, Hkv, M, device="cuda")
        ours_top, ref_top = logits.gather(-1, topk_slots(logits, K)), logits.topk(K).values
        assert torch.equal(ours_top, ref_top)  # the same values; equal values may come in another order
        ref = do_bench(lambda x=logits, k=K: x.topk(k, dim=-1))
        ours = do_bench(lambda x=logits, k=K: x.gather(-1, topk_slots(x, k)))
        print(f"| [{B}, {T}, {Hkv}, {M}], {K} | {ref:.3f} | {ours:.3f} | {ref / ours:.1f}x |", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--topk", action="store_true", help="time the router's top-K (topk_slots) only")
    parser.add_argument("--variants", default="", help="comma-separated launch variants to time as well")
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES), help="BxTxMxK,...")
    args = parser.parse_args()
    known = {*VARIANTS, *SCAN_VARIANTS, *LEVELS}
    for name in filter(None, args.variants.split(",")):
        parts = name.split("+")
        if any(part not in (VARIANTS if len(parts) > 1 else known) for part in parts):
            parser.error(
                f"--variants: unknown variant {name!r}; allowed: {', '.join(sorted(known))}, "
                f"and launch variants joined by '+' ({', '.join(VARIANTS)})"
            )
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        assert all(len(s) == 4 for s in shapes)
    except (ValueError, AssertionError):
        parser.error(f"--shapes: expected BxTxMxK[,BxTxMxK...], got {args.shapes!r}")
    if args.topk:
        return time_topk([(1, 32768, 3, 256, 32), (1, 16384, 3, 64, 8), (*shapes[0][:2], H, *shapes[0][2:])])
    default, default_scan = raven_chunk.launch_config, raven_chunk.scan_config
    results = []
    for B, T, M, K in shapes:
        raven_chunk.launch_config, raven_chunk.scan_config = default, default_scan
        results.append(case(B, T, M, K, None, True))
        for name in filter(None, args.variants.split(",")):
            if name in SCAN_VARIANTS and not raven_chunk.split_scan(M, D, B * H):
                continue
            raven_chunk.launch_config, raven_chunk.scan_config = default, default_scan
            results.append(case(B, T, M, K, name, False))
    print("\n| case | fwd ms | fwd+bwd ms |\n| --- | --- | --- |")
    for name, t_f, t_fb in results:
        print(f"| {name} | {t_f:.2f} | {t_fb:.2f} |")


if __name__ == "__main__":
    main()
