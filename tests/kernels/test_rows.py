"""kernels/rows.py's per-row helpers (Triton, interpreted on CPU): the top-K picked by rounds of a max is the
bitonic sort's first K, ties and signed zeros and -inf included."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from raven_kernels.rows import indices_by_score, top_indices_by_score

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def sort_and_pick(x, by_sort, picked, M: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    o_m = tl.arange(0, BM)
    b_x = tl.load(x + o_m[None, :], mask=(o_m < M)[None, :], other=float("-inf"))  # [1, BM]
    tl.store(by_sort + o_m[None, :], indices_by_score(b_x, M, BM))
    tl.store(picked + tl.arange(0, BK), top_indices_by_score(b_x, M, BM, BK))


@pytest.mark.parametrize(
    "M, K, scores",
    [(64, 8, "normal"), (64, 8, "ties"), (37, 8, "ties"), (5, 8, "normal"), (64, 16, "signed zeros"), (12, 4, "-inf")],
)
def test_top_indices_are_the_sorts_first(M, K, scores):
    g = torch.Generator().manual_seed(M + K)
    BM = triton.next_power_of_2(M)
    for _ in range(10):
        x = {
            "normal": lambda: torch.randn(M, generator=g),
            "ties": lambda: torch.randint(0, 4, (M,), generator=g).float(),  # many equal: the lower slot first
            "signed zeros": lambda: torch.where(torch.rand(M, generator=g) < 0.5, 0.0, -0.0),
            "-inf": lambda: torch.randn(M, generator=g).masked_fill(torch.rand(M, generator=g) < 0.5, float("-inf")),
        }[scores]().to(DEVICE)
        by_sort = torch.empty(BM, dtype=torch.int64, device=DEVICE)
        picked = torch.empty(K, dtype=torch.int64, device=DEVICE)
        sort_and_pick[(1,)](x, by_sort, picked, M, BM, K)
        n = min(K, M)  # past the M scores the picks are unspecified
        assert torch.equal(picked[:n], by_sort[:n])
        if scores != "signed zeros":  # the keys rank +0 above -0, which torch.sort takes as equal
            assert torch.equal(by_sort[:n], torch.sort(-x.cpu(), stable=True).indices[:n].to(DEVICE))
