"""Registers, spill stack and shared memory of Raven's per-chunk and decode kernels on sm_90, without a GPU: each
kernel is compiled with Triton for Hopper under its launch settings and its cubin read with the cuobjdump that
ships with Triton.
Check a launch change here first: a spilling kernel is slow, and one that needs over 227 KB of shared memory does
not launch.

    python scripts/kernel_resources.py [--d 128] [--slots 256] [--kernels o,dq,dkv,dlf,h,dh,gate,dhc,scan,decode]

Prints one row per kernel: slots per block, warps, stages, registers per thread, stack bytes, shared bytes.
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

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.raven import chunk, chunk_bwd, chunk_h, fused_recurrent  # noqa: E402

KERNELS = {
    "o": chunk.raven_fwd_kernel_o,
    "dq": chunk_bwd.raven_bwd_kernel_dq,
    "dkv": chunk_bwd.raven_bwd_kernel_dkv,
    "dlf": chunk_bwd.raven_bwd_kernel_dlf,
    "h": chunk_h.raven_fwd_kernel_h,
    "dh": chunk_h.raven_bwd_kernel_dh,
    "gate": chunk_h.raven_fwd_kernel_gate,
    "dhc": chunk_h.raven_bwd_kernel_dhc,
    "scan": chunk_h.raven_fwd_kernel_scan,
    "decode": fused_recurrent.raven_fwd_kernel_fused_recurrent,
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
}  # bf16 in training
INT32 = {"chunk_bos", "chunk_len", "seq_chunks", "idx", "cu_seqlens"}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def resources(fn, constants: dict, num_warps: int, num_stages: int) -> dict[str, int]:
    """Compile `fn` for sm_90 with these constexpr values (every other argument a pointer or a float scale)."""
    signature, constexprs = {}, {}
    for i, name in enumerate(inspect.signature(fn.fn).parameters):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
        elif name == "scale":
            signature[name] = "fp32"
        elif name == "T":
            signature[name] = "i32"
        else:
            signature[name] = "*i32" if name in INT32 else "*bf16" if name in INPUT_DTYPE else "*fp32"
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs),
        target=GPUTarget("cuda", 90, 128),
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
        constants.update(BK=32, CONTRIB=True, REVERSE=False, USE_H0=True, STORE_HT=True, USE_DHT=True, STORE_DH0=True)
        if name == "decode":
            constants.update(BG=1, IS_VARLEN=False)
        used = resources(KERNELS[name], constants, warps, stages)
        rows.append((name, BM, warps, stages, used["registers"], used["stack"], used["shared"]))
    return rows


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
