"""Kernel benchmark: the toolkit's Triton kernels against torch SDPA (flash, causal) and, where importable, fla.

    python scripts/bench/bench_kernels.py                      # all cases, both shapes; a markdown table last
    python scripts/bench/bench_kernels.py --only raven --json out.json
    python scripts/bench/bench_kernels.py --only sse --without-fla  # ours alone, no fla compilation
    python scripts/bench/bench_kernels.py --only raven --with-fla-gsa --fla-configs 1  # fla chunk_gsa's memory, untuned

Every case times forward and forward+backward (median of triton.testing.do_bench, after a warm-up), reports
tokens/s of forward+backward, the peak memory a forward+backward adds on top of its inputs, and the first call's
seconds (compilation and autotuning included). Decode cases time one step and report the bytes each implementation
must move (the state it reads plus what it writes back) per second, against a device-to-device copy's. Peers are
measured in the same run on the same inputs:
- Raven (M slots, top-K): ours `chunk_raven` (default checkpoint_level 2, and 0: gates and chunk states kept for
  the backward) vs fla `chunk_gsa` (its default checkpoint_level 2) with the dense gates g = log-retention,
  s = 1 - exp(g) (the Gated Slot Attention form of the same recurrence; only with --with-fla-gsa, since it
  compiles and autotunes for minutes: ../shared/README.md has its numbers from the same H100 type).
- SSE n4k1 (+ shared partition, varlen): ours `sse_varlen` on `chunk_gla_entries` vs fla `chunk_gla` at the same H
  and D (dense lower bound); also ours `chunk_gla` alone.
- SILA: ours `fused_recurrent_sila` vs fla `chunk_gla` and `fused_recurrent_delta_rule`.
A case that fails prints its error in the table instead of stopping the run.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

DEVICE = "cuda"
DTYPE = torch.bfloat16
SHAPES = {"B4_T4096": (4, 4096), "B1_T32768": (1, 32768)}
H, D = 16, 128


def first_configs(n: int) -> None:
    """Make every Triton autotuner built from now on (fla's, at its import) try only its first n configs: fla's
    chunk_gsa then compiles within the device's 10-minute command. Its peak memory does not depend on the config
    chosen; its times become those of an untuned kernel (no faster than its tuned ones)."""
    from triton.runtime.autotuner import Autotuner

    init = Autotuner.__init__

    def limited(self, fn, arg_names, configs, *args, **kwargs):
        init(self, fn, arg_names, configs[:n], *args, **kwargs)

    Autotuner.__init__ = limited


def fla_ops():
    try:
        from fla.ops.delta_rule import fused_recurrent_delta_rule
        from fla.ops.gla import chunk_gla
        from fla.ops.gsa import chunk_gsa, fused_recurrent_gsa
    except ImportError:
        return None
    return {
        "chunk_gla": chunk_gla,
        "chunk_gsa": chunk_gsa,
        "fused_recurrent_gsa": fused_recurrent_gsa,
        "fused_recurrent_delta_rule": fused_recurrent_delta_rule,
    }


def leaf(x: torch.Tensor, grad: bool = True) -> torch.Tensor:
    return x.detach().requires_grad_(grad)


def randn(*shape, dtype=DTYPE, grad=True):
    return leaf(torch.randn(*shape, device=DEVICE, dtype=dtype), grad)


def raven_inputs(B, T, M, K, G=1):
    """q [B, T, H, G, d], k, v [B, T, H, d], a [B, T, H], idx/r [B, T, H, K], and the dense log_f [B, T, H, M]."""
    q, k, v = randn(B, T, H, G, D), randn(B, T, H, D), randn(B, T, H, D)
    a = leaf(-F.softplus(torch.randn(B, T, H, device=DEVICE)) * 4.0)  # log-decay per head, < 0
    logits = torch.randn(B, T, H, M, device=DEVICE)
    top, idx = logits.sigmoid().topk(K, dim=-1)
    r = leaf(top / top.sum(-1, keepdim=True))
    log_f = torch.zeros(B, T, H, M, device=DEVICE).scatter(-1, idx, a.detach().unsqueeze(-1) * r.detach())
    return q, k, v, a, idx, r, log_f


def case_raven_ours(B, T, M, K, level=2):
    from raven_kernels.raven import chunk_raven

    q, k, v, a, idx, r, _ = raven_inputs(B, T, M, K)
    return lambda: chunk_raven(q, k, v, a, idx, r, D**-0.5, M, checkpoint_level=level)[0], [q, k, v, a, r]


def case_raven_fla(B, T, M, K):
    q, k, v, _, _, _, log_f = raven_inputs(B, T, M, K)
    q = leaf(q.detach()[:, :, :, 0])
    g = leaf(log_f.to(DTYPE))
    s = leaf((-torch.expm1(log_f)).to(DTYPE))
    chunk_gsa = FLA["chunk_gsa"]
    return lambda: chunk_gsa(q, k, v, s, g, scale=D**-0.5)[0], [q, k, v, s, g]


def sse_inputs(B, T, N=4, G=1):
    """n4k1 with the shared partition: 2 entries per token (its routed partition, then the shared one, index N)."""
    Me = 2
    q, v = randn(B, T, H, G, Me, D), randn(B, T, H, D)
    k = leaf(torch.randn(B, T, H, Me, D, device=DEVICE).softmax(-1).to(DTYPE))
    log_g = leaf((F.logsigmoid(torch.randn(B, T, H, 1, D, device=DEVICE)) / 16).expand(B, T, H, Me, D).contiguous())
    idx = torch.stack([torch.randint(0, N, (B, T, H), device=DEVICE), torch.full((B, T, H), N, device=DEVICE)], -1)
    return q, k, v, log_g, idx, N + 1


def case_sse_ours(B, T):
    import raven_kernels.sse
    from raven_layers.sse_forms import sse_parallel

    q, k, v, log_g, idx, P = sse_inputs(B, T)
    varlen = sse_parallel("varlen", raven_kernels.sse)
    return lambda: varlen(q, k, v, log_g, idx, P, D**-0.5)[0], [q, k, v, log_g]


def gla_inputs(B, T):
    q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
    g = leaf(F.logsigmoid(torch.randn(B, T, H, D, device=DEVICE)) / 16)
    return q, k, v, g


def case_gla_ours(B, T):
    from raven_kernels.sse import chunk_gla

    q, k, v, g = gla_inputs(B, T)
    q5 = leaf(q.detach().unsqueeze(3))
    return lambda: chunk_gla(q5, k, v, g, D**-0.5)[0], [q5, k, v, g]


def case_gla_fla(B, T):
    q, k, v, g = gla_inputs(B, T)
    chunk_gla = FLA["chunk_gla"]
    return lambda: chunk_gla(q, k, v, g, scale=D**-0.5)[0], [q, k, v, g]


def l2(x):
    return leaf(F.normalize(x.float(), dim=-1).to(x.dtype))


def case_sila_ours(B, T):
    from raven_kernels.sila import fused_recurrent_sila

    q, k, v = l2(randn(B, T, H, 1, D)), l2(randn(B, T, H, D)), randn(B, T, H, D)
    alpha = leaf(torch.rand(B, T, H, 1, device=DEVICE))
    beta_x, gamma_x = randn(B, T, H, dtype=torch.float32), leaf(torch.randn(B, T, H, device=DEVICE) + 2.0)
    w_beta, w_gamma = randn(H, D, dtype=torch.float32), randn(H, D, dtype=torch.float32)
    with torch.no_grad():
        w_beta.mul_(0.1), w_gamma.mul_(0.1)
    args = [q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma]
    return lambda: fused_recurrent_sila(*args)[0], args


def case_delta_fla(B, T):
    q, k, v = l2(randn(B, T, H, D)), l2(randn(B, T, H, D)), randn(B, T, H, D)
    beta = leaf(torch.rand(B, T, H, device=DEVICE, dtype=DTYPE))
    fn = FLA["fused_recurrent_delta_rule"]
    return lambda: fn(q, k, v, beta)[0], [q, k, v, beta]


def case_sdpa(B, T):
    q, k, v = randn(B, H, T, D), randn(B, H, T, D), randn(B, H, T, D)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v]


def measure(build: Callable, *args) -> dict:
    """Times and memory of one training case: build() -> (forward function, leaf inputs)."""
    from raven_kernels.timing import time_training

    fn, inputs = build(*args)
    return time_training(fn, inputs)


def measure_decode(build: Callable, state_bytes: int, *args) -> dict:
    from triton.testing import do_bench

    step = build(*args)
    clock = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - clock
    ms = do_bench(step, warmup=25, rep=200, return_mode="median")
    return {"step_us": ms * 1e3, "state_tb_s": state_bytes / (ms * 1e-3) / 1e12, "first_s": first}


def decode_raven_ours(B, M, K):
    from raven_kernels.raven import fused_recurrent_raven

    q, k, v, a, idx, r, _ = raven_inputs(B, 1, M, K)
    state = tuple(torch.randn(B, H, M, D, device=DEVICE) for _ in range(2))
    args = [x.detach() for x in (q, k, v, a)]
    return lambda: fused_recurrent_raven(*args, idx, r.detach(), D**-0.5, M, initial_state=state)


def decode_raven_fla(B, M, K):
    q, k, v, _, _, _, log_f = raven_inputs(B, 1, M, K)
    g, s = log_f.to(DTYPE), (-torch.expm1(log_f)).to(DTYPE)
    state = tuple(
        torch.randn(B, H, D, M, device=DEVICE) if i == 0 else torch.randn(B, H, M, D, device=DEVICE) for i in range(2)
    )
    fn = FLA["fused_recurrent_gsa"]
    q = q.detach()[:, :, :, 0]
    return lambda: fn(q, k.detach(), v.detach(), s, g, initial_state=state, output_final_state=True)


def decode_sdpa(B, context):
    q = torch.randn(B, H, 1, D, device=DEVICE, dtype=DTYPE)
    k, v = (torch.randn(B, H, context, D, device=DEVICE, dtype=DTYPE) for _ in range(2))
    return lambda: F.scaled_dot_product_attention(q, k, v)


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    x = torch.empty(2**28, device=DEVICE, dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=50, return_mode="median")
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e12


FLA = None
WITH_GSA = False  # fla's chunk_gsa compiles and autotunes for minutes before its first call returns


def training_cases(only: set[str]) -> list[tuple[str, str, str, Callable, tuple]]:
    """(group, name, shape, build, args)."""
    cases = []
    for shape, (B, T) in SHAPES.items():
        if "sdpa" in only:
            cases.append(("peer", "torch SDPA (flash, causal)", shape, case_sdpa, (B, T)))
        if "raven" in only:
            for M, K in ((256, 32), (64, 8)):
                cases.append(("raven", f"ours chunk_raven M={M} top-{K}", shape, case_raven_ours, (B, T, M, K)))
                label = f"ours chunk_raven M={M} top-{K} checkpoint_level=0"
                cases.append(("raven", label, shape, case_raven_ours, (B, T, M, K, 0)))
                if FLA and WITH_GSA:
                    cases.append(("raven", f"fla chunk_gsa M={M} (dense gates)", shape, case_raven_fla, (B, T, M, K)))
        if "sse" in only:
            cases.append(("sse", "ours sse_varlen n4k1 + shared", shape, case_sse_ours, (B, T)))
            cases.append(("sse", "ours chunk_gla (dense)", shape, case_gla_ours, (B, T)))
            if FLA:
                cases.append(("sse", "fla chunk_gla (dense)", shape, case_gla_fla, (B, T)))
        if "sila" in only:
            cases.append(("sila", "ours fused_recurrent_sila", shape, case_sila_ours, (B, T)))
            if FLA:
                cases.append(("sila", "fla fused_recurrent_delta_rule", shape, case_delta_fla, (B, T)))
    return cases


def main() -> None:
    global FLA, WITH_GSA
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="sdpa,raven,sse,sila,decode", help="comma-separated groups")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {list(SHAPES)}")
    parser.add_argument("--json", default=None, help="also write every number here")
    parser.add_argument("--with-fla-gsa", action="store_true", help="also time fla's chunk_gsa (minutes to compile)")
    parser.add_argument("--without-fla", action="store_true", help="time no fla peer (its chunk_gla compiles ~5 min)")
    parser.add_argument(
        "--fla-configs", type=int, default=None, help="autotune fla over its first N configs only (for its memory)"
    )
    args = parser.parse_args()
    if args.fla_configs is not None:
        if args.fla_configs < 1:
            parser.error(f"--fla-configs must be at least 1, got {args.fla_configs}")
        first_configs(args.fla_configs)
    WITH_GSA = args.with_fla_gsa
    only = set(args.only.split(","))
    for name in list(SHAPES):
        if name not in args.shapes.split(","):
            del SHAPES[name]
    FLA = None if args.without_fla else fla_ops()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    import triton

    env = {
        "gpu": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": None if FLA is None else __import__("fla").__version__,
        "fla_configs": args.fla_configs,
        "date": time.strftime("%Y-%m-%d"),
        "copy_tb_s": copy_bandwidth(),
    }
    rows = []
    for group, name, shape, build, case_args in training_cases(only):
        try:
            result = measure(build, *case_args)
            B, T = SHAPES[shape]
            result["tok_s"] = B * T / (result["fwd_bwd_ms"] * 1e-3)
        except Exception as err:  # one broken case must not hide the others
            traceback.print_exc()
            result = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"}
        rows.append({"group": group, "case": name, "shape": shape, **result})
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    decode = []
    if "decode" in only:
        B = 64
        for M, K in ((256, 32), (64, 8)):
            slot = 2 * B * H * D * 4  # one slot of S^k and S^v, float32, over the batch and heads
            # ours reads every slot once and rewrites the K selected ones in place; fla reads and writes them all
            decode.append(("ours fused_recurrent_raven", M, decode_raven_ours, slot * (M + K), (B, M, K)))
            if FLA:
                decode.append(("fla fused_recurrent_gsa", M, decode_raven_fla, slot * 2 * M, (B, M, K)))
        for context in (4096, 16384):
            decode.append(
                (f"torch SDPA, bf16 KV cache {context}", None, decode_sdpa, 2 * B * H * context * D * 2, (B, context))
            )
    drows = []
    for name, M, build, state_bytes, case_args in decode:
        try:
            result = measure_decode(build, state_bytes, *case_args)
            result["of_copy"] = result["state_tb_s"] / env["copy_tb_s"]
        except Exception as err:
            traceback.print_exc()
            result = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"}
        drows.append({"case": name, "M": M, **result})
        print(json.dumps(drows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "training": rows, "decode": drows}, f, indent=1)

    print(
        f"\n{env['gpu']}, torch {env['torch']}, triton {env['triton']}, fla {env['fla']}, {env['date']}; "
        f"H={H}, D={D}, bf16; copy bandwidth {env['copy_tb_s']:.2f} TB/s"
        + (f"; fla autotuned over its first {args.fla_configs} configs only" if args.fla_configs else "")
    )
    print("\n| case | shape | fwd ms | fwd+bwd ms | Mtok/s | peak MiB | first call s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | {r['shape']} | {r['error']} | | | | |")
        else:
            print(
                f"| {r['case']} | {r['shape']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                f"{r['tok_s'] / 1e6:.2f} | {r['peak_mib']:.0f} | {r['first_s']:.1f} |"
            )
    if drows:
        print("\n| decode step, B=64 | M | us | state bytes moved, TB/s | of copy bandwidth |")
        print("| --- | --- | --- | --- | --- |")
        for r in drows:
            if "error" in r:
                print(f"| {r['case']} | {r['M']} | {r['error']} | | |")
            else:
                print(
                    f"| {r['case']} | {r['M'] or '-'} | {r['step_us']:.1f} | {r['state_tb_s']:.2f} | "
                    f"{r['of_copy']:.0%} |"
                )


if __name__ == "__main__":
    main()
