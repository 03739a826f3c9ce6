"""scripts/bench/kernel_resources.py: Raven's per-chunk kernels, SILA's kernels and the mixers' one-kernel decode
steps, compiled offline for sm_90 under their launch settings, fit in Hopper's shared memory and spill at most a
little, and SILA's two sequential sweeps and the decode steps not at all (the launch and layout changes this guards
are checked nowhere else without a GPU). Runs the script in
a fresh interpreter: the tests' own Triton runs interpreted."""

import os
import subprocess
import sys
from pathlib import Path

import triton

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "kernel_resources.py"
SHARED_LIMIT = 227 * 1024  # bytes of shared memory per block on sm_90
KERNELS = ["o", "dq", "dkv", "dlf", "h", "dh", "gate", "dhc", "scan", "decode"]
SILA = ["sila_fwd", "sila_o", "sila_dq", "sila_bwd", "sila_dkv"]
STEPS = ["sila_step", "sila_step_query", "raven_step", "sse_step"]  # sila_step_query: a memory per query head
SWEEPS = {"sila_fwd", "sila_bwd", *STEPS}  # one step's latency is the whole kernel's: a spill there costs every step


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)


def test_training_kernels_fit_hopper_at_d128():
    assert (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()
    result = run_script("--d", "128", "--slots", "256")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.strip("| ").split(" | ") for line in result.stdout.splitlines() if line.startswith("| ")][2:]
    assert [row[0] for row in rows] == KERNELS + SILA + STEPS
    for name, _, _, _, registers, stack, shared in rows:
        assert 0 < int(registers) <= 255, name
        assert int(shared) <= SHARED_LIMIT, f"{name} needs {shared} B of shared memory"
        assert int(stack) <= (0 if name in SWEEPS else 1024), f"{name} spills {stack} B per thread"


def test_unknown_kernel_is_named():
    result = run_script("--kernels", "o,dx")
    assert result.returncode != 0
    allowed = ", ".join(KERNELS + SILA + STEPS)
    assert f"unknown kernel 'dx'; allowed: {allowed}" in result.stderr
