"""Registers, spill stack and shared memory of Raven's per-chunk and decode kernels, SILA's kernels and the mixers'
one-kernel decode steps on sm_90, without a GPU: each kernel is compiled with Triton for Hopper under its launch
settings and its cubin read with the cuobjdump that ships with Triton.
Check a launch or layout change here first: a spilling kernel is slow, and one that needs over 227 KB of shared
memory does not launch.

    python scripts/bench/kernel_resources.py [--d 128] [--slots 256] [--kernels o,dq,...,sila_fwd,sila_bwd,...]

Prints one row per kernel: slots per block (Raven), warps, stages, registers per thread, stack bytes, shared bytes.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from raven_kernels import chunked  # noqa: E402
from raven_kernels.raven import chunk, chunk_bwd, chunk_h, fused_recurrent  # noqa: E402
from raven_kernels.sila import fused_recurrent_bwd as sila_bwd_kernels  # noqa: E402
from raven_kernels.sila import fused_recurrent_fwd as sila_fwd_kernels  # noqa: E402
from raven_kernels.sila import utils as sila_utils  # noqa: E402
from raven_kernels.sila.fused_recurrent import CHUNK_SIZE as SILA_CHUNK  # noqa: E402
from raven_kernels.sse import fused_recurrent as sse_recurrent  # noqa: E402

KERNELS = {
    "o": chunk.raven_fwd_kernel_o,
    "dq": chunk_bwd.raven_bwd_kernel_dq,
    "dkv": chunk_bwd.raven_bwd_kernel_dkv,
    "dlf": chunk_bwd.raven_bwd_kernel_dlf,
    "h": chunk_h.raven_fwd_kernel_h,
    "dh": chunk_h.raven_bwd_kernel_dh,
    "gate": chunk_h.raven_fwd_kernel_gate,
    "dhc": chunk_h.raven_bwd_kernel_dhc,
    "scan": chunked.scan_fwd_kernel,
    "decode": fused_recurrent.raven_fwd_kernel_fused_recurrent,
    "sila_fwd": sila_fwd_kernels.sila_fwd_kernel_recurrent,  # the training sweep (SAVE), not the decode step
    "sila_o": sila_fwd_kernels.sila_fwd_kernel_output,
    "sila_dq": sila_bwd_kernels.sila_bwd_kernel_dq,
    "sila_bwd": sila_bwd_kernels.sila_bwd_kernel_recurrent,
    "sila_dkv": sila_bwd_kernels.sila_bwd_kernel_dkv,
    "sila_step": sila_fwd_kernels.sila_fwd_kernel_decode,  # the one-kernel decode steps, from a layer's products
    "sila_step_query": sila_fwd_kernels.sila_fwd_kernel_decode,  # SILA's step with a memory per query head
    "raven_step": fused_recurrent.raven_fwd_kernel_decode,
    "sse_step": sse_recurrent.sse_fwd_kernel_step,
}
INPUT_DTYPE = {
    "q",
    "k",
    "v",
    "do",
    "o",
    "dq",
    "dk",
    "dv",
    "hk",
    "hv",
    "dhk",
    "dhv",
    "xk",
    "xv",
    "p",
    "ds",
    *("x", "e", "dx", "og", "qa", "ka", "logits", "decay_x", "beta_x", "gamma_x", "alpha_x", "out_gate", "tail"),
}  # bf16 in training, and the decode steps' products
INT32 = {"chunk_bos", "chunk_len", "seq_chunks", "idx", "cu_seqlens", "state_offsets", "chunk_indices", "counter"}
STEP_FLOATS = {"scale", "norm_eps", "alpha", "inv_tau"}  # the decode steps' floats (elsewhere alpha is a pointer)
POINTER_TYPES = {**{n: "*bf16" for n in INPUT_DTYPE}, **{n: "*i32" for n in INT32}, "mask": "*u8"}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def resources(fn, constants: dict, num_warps: int, num_stages: int, floats=frozenset({"scale"})) -> dict[str, int]:
    """Compile `fn` for sm_90 with these constexpr values (and the defaults the kernel gives the others; every other
    argument a pointer, one of `floats`, or an integer: T, HID and strides).

    Pointers are marked 16-byte aligned, as the launcher marks torch's allocations: without that Triton cannot
    vectorise the loads and the compiled kernel is not the one that runs.
    """
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, parameter) in enumerate(inspect.signature(fn.fn).parameters.items()):
        if name in constants or parameter.default is not inspect.Parameter.empty:  # a constexpr, or its default
            signature[name] = "constexpr"
            constexprs[(i,)] = constants.get(name, parameter.default)
        elif name in floats:
            signature[name] = "fp32"
        elif name in ("T", "HID") or name.startswith("stride_"):
            signature[name] = "i32"
        else:
            signature[name] = POINTER_TYPES.get(name, "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True)
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    if match is None:
        raise RuntimeError(f"cuobjdump gave no resource line for {fn.__name__}: {usage.stdout[:200]}")
    return {"registers": int(match[1]), "stack": int(match[2]), "shared": compiled.metadata.shared}


def kernel_rows(D: int, M: int, names: list[str]) -> list[tuple]:
    """(name, slots per block, warps, stages, registers, stack, shared) of each kernel as chunk_raven launches it."""
    BM_max, BD = chunk.block_sizes(M, D)
    launch = chunk.launch_config(D)
    BP, BM_scan, BD_scan, warps_scan = chunk.scan_config(M, D)
    BM_seq, BD_seq = chunk.seq_blocks(M, D, NH=64)
    for name in names:
        if name not in KERNELS:
            raise ValueError(f"--kernels: unknown kernel {name!r}; allowed: {', '.join(KERNELS)}")
    rows = []
    for name in names:
        if name in STEPS:
            rows.append(step_row(name, D, M))
            continue
        if name.startswith("sila_"):
            rows.append(sila_row(name, D))
            continue
        if name in launch:
            BM, warps, stages = launch[name]
            BM, block_d = min(BM, BM_max), BD
        elif name == "scan":  # chunk.scan
            BM, warps, stages, block_d = BM_scan, warps_scan, 3, BD_scan
        elif name in ("h", "dh"):  # chunk.sequential_states, chunk.state_grads
            BM, warps, stages, block_d = BM_seq, 4, 3, BD_seq
        elif name == "decode":  # fused_recurrent_raven at batch 64, 16 heads
            (BM, warps), stages, block_d = fused_recurrent.decode_config(M, 1, D), 3, BD
        else:  # the per-chunk state kernels (chunk.gates with contributions, chunk.state_grads)
            BM, warps, stages, block_d = min(32, BM_max), 8 if name == "gate" else 4, 3, BD
        constants = dict(H=16, G=1, M=M, K=32, D=D, BT=chunk.BT, BC=chunk.BC, BP=BP, BM=BM, BD=block_d, EXACT=False)
        constants.update(BK=32, CONTRIB=True, PAIR=True, REVERSE=False, USE_H0=True, STORE_HT=True)
        constants.update(USE_DHT=True, STORE_DH0=True)
        if name == "decode":
            constants.update(BG=1, IS_VARLEN=False, NS=1, MB=-(-M // BM))  # batch 64 fills the SMs: no slot split
            constants.update(BS=1, SHARED=fused_recurrent.values_shared(BM, block_d, warps))
        used = resources(KERNELS[name], constants, warps, stages)
        rows.append((name, BM, warps, stages, used["registers"], used["stack"], used["shared"]))
    return rows


def sila_row(name: str, D: int) -> tuple:
    """(name, "-", warps, stages, registers, stack, shared) of a SILA kernel as fused_recurrent_sila launches it at
    d_k = d_v = D, no mask, fixed-length batch, one query head per key head."""
    warps = sila_utils.launch_settings(D, D)["sweep" if name in ("sila_fwd", "sila_bwd") else "chunk"]
    constants = dict(H=16, G=1, K=D, V=D, KB=sila_utils.sweep_block(D), CHUNK=SILA_CHUNK, PRECISION="tf32")
    constants.update(STORE_HT=False, SAVE=True, INLINE_OUTPUT=False, STORE_DH0=False, HAS_MASK=False, IS_VARLEN=False)
    used = resources(KERNELS[name], constants, warps, 1)
    return (name, "-", warps, 1, used["registers"], used["stack"], used["shared"])


STEPS = ("sila_step", "sila_step_query", "raven_step", "sse_step")


def step_row(name: str, D: int, M: int) -> tuple:
    """(name, slots per block or "-", warps, stages, registers, stack, shared) of a one-kernel decode step as its
    mixer launches it at batch 1 (one program per key/value head): SmolLM2's 3 key/value heads of 3 query heads,
    head dim D, every option on (q/k norms, output gate and norm, padding mask); Raven with M slots and top-32, SSE
    with its recipe's n4k1, LoRA rank 64 and the shared partition, SILA with a 4-tap convolution (sila_step_query:
    with a memory per query head, `state_heads: query`, so 9 memories of one query head each)."""
    G, BG = 3, 4
    flags = dict(HAS_QK_NORM=True, HAS_MASK=True, SILU=True)
    if name in ("sila_step", "sila_step_query"):
        warps, BM = sila_utils.step_warps(D, D), "-"
        H, G = (9, 1) if name == "sila_step_query" else (3, G)
        constants = dict(H=H, G=G, K=D, KB=sila_utils.sweep_block(D), TAPS=4, GATED=True, **flags)
    elif name == "raven_step":
        (BM, warps), K = fused_recurrent.decode_config(M, G, D), min(32, M)
        constants = dict(H=3, G=G, M=M, D=D, K=K, BG=BG, BM=BM, BD=D, BK=K, BMALL=M, NS=1, MB=-(-M // BM), BS=1)
        sort = fused_recurrent.DECODE_TOP_K_BY == "sort"
        constants.update(flags, TOPK_SORT=sort, SHARED=fused_recurrent.values_shared(BM, D, warps))
    else:
        warps, BM, r = sse_recurrent.step_warps(D, D, 1, torch.device("meta")), "-", 64
        constants = dict(H=3, G=G, N=4, C=D, D=D, R=r, RA=16, WK=1, RK=1, SHARED=1, NORM=True, GATED=True)
        constants.update(HAS_MASK=True, BG=BG, BN=4, BC=D, BD=D, BR=r, BRA=16)
    used = resources(KERNELS[name], constants, warps, 1, STEP_FLOATS)
    return (name, BM, warps, 1, used["registers"], used["stack"], used["shared"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=128, help="head dim")
    parser.add_argument("--slots", type=int, default=256, help="M")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {list(KERNELS)}")
    args = parser.parse_args()
    try:
        rows = kernel_rows(args.d, args.slots, args.kernels.split(","))
    except ValueError as error:
        parser.error(str(error))
    print(f"sm_90, d = {args.d}, M = {args.slots}, bf16 operands, fast path only (EXACT off)")
    print("| kernel | slots/block | warps | stages | registers | stack B | shared B |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")


if __name__ == "__main__":
    main()
