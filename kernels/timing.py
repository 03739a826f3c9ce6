"""How the kernel benchmarks time a training op (scripts/bench/bench_kernels.py, kernels/<mixer>/benchmark.py); CUDA."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


def kernel_times(step: Callable[[], object], n: int = 1) -> list[tuple[float, float, str]]:
    """(device ms per call, launches per call, name) of every CUDA kernel that `step()` runs, the slowest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    rows = [(e.device_time_total / n / 1e3, e.count / n, e.key) for e in prof.key_averages() if e.device_time_total]
    return sorted(rows, reverse=True)


def time_training(fn: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor], profile: bool = False) -> dict:
    """Time the forward `fn()` (-> one output tensor) alone and with its backward into `leaves`.

    Returns first_s (the first forward+backward: compilation and autotuning), peak_mib (what one forward+backward
    allocates on top of what is already allocated), fwd_ms and fwd_bwd_ms (medians of triton's do_bench after a
    warm-up, the output's gradient fixed beforehand) and, with profile, "kernels" as `kernel_times` gives them for
    one forward+backward.
    """
    from triton.testing import do_bench

    torch.cuda.synchronize()
    grad = None

    def fwd_bwd():
        nonlocal grad
        out = fn()
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)

    clock = time.perf_counter()
    fwd_bwd()
    torch.cuda.synchronize()
    first = time.perf_counter() - clock
    for x in leaves:
        x.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    with torch.no_grad():
        fwd = do_bench(fn, warmup=25, rep=100, return_mode="median")
    both = do_bench(fwd_bwd, warmup=25, rep=100, grad_to_none=list(leaves), return_mode="median")
    result = {"first_s": first, "peak_mib": peak / 2**20, "fwd_ms": fwd, "fwd_bwd_ms": both}
    if profile:
        for x in leaves:  # as in the timed calls: gradients assigned, not accumulated
            x.grad = None
        result["kernels"] = kernel_times(fwd_bwd)
    return result


def time_call(fn: Callable, inputs: Sequence[torch.Tensor], profile: bool = False) -> dict:
    """`time_training` of fn(*inputs)[0], every input a leaf."""
    return time_training(lambda: fn(*inputs)[0], inputs, profile=profile)
