"""merge_fwd_kernel (Triton, interpreted on CPU) against the softmax merge in PyTorch: many ranges read in blocks,
padded query heads and channels left out, empty ranges weighing nothing."""

from __future__ import annotations

import pytest
import torch

from raven_kernels.split import Partials

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "rows, NS, G, D",
    [
        (3, 16, 3, 300),  # BD 512: 8 ranges per load, two loads; G and D padded (BG 4)
        (2, 128, 3, 64),  # batch 1's many ranges: two loads of 64
        (5, 1, 1, 16),  # large batches: no split
    ],
)
def test_merge_matches_the_softmax_merge(rows, NS, G, D):
    g = torch.Generator().manual_seed(rows * NS)
    part = Partials(rows, NS, G, D, torch.device(DEVICE))
    part.m.copy_(torch.randn(part.m.shape, generator=g) * 3)
    part.l.copy_(torch.rand(part.l.shape, generator=g) + 0.1)
    part.o.copy_(torch.randn(part.o.shape, generator=g))
    if NS > 1:
        part.m[:, 1] = -1e30  # a range with no entry
        part.l[:, 1] = 0.0
    out = part.merge(torch.empty(rows, G, D, device=DEVICE))

    m, sums, o = part.m[:, :, :G].cpu(), part.l[:, :, :G].cpu(), part.o[:, :, :G, :D].cpu()  # [rows, NS, G(, D)]
    w = torch.exp(m - m.amax(1, keepdim=True))
    ref = (w[..., None] * o).sum(1) / (w * sums).sum(1)[..., None]  # [rows, G, D]
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_split_count_covers_the_gpu_and_keeps_full_rows_whole(monkeypatch):
    """Rows x ranges reach the wanted programs (a power of 2, at most the blocks); with `whole_from`, rows that alone
    give that share of them stay one range (Raven's decode: 8 one-warp programs an SM, whole from half)."""
    from raven_kernels import split
    from raven_kernels.raven.fused_recurrent import slot_ranges

    monkeypatch.setattr(split, "programs_wanted", lambda device, per_sm=2: 132 * per_sm)  # an H200's SMs
    cuda = torch.device("cuda")
    assert slot_ranges(3, 64, 1, cuda) == 64  # batch 1 at 3 heads: every block its own range
    assert split.split_count(96, 64, cuda, per_sm=2) == 4  # batch 32: the old split
    assert slot_ranges(96, 64, 1, cuda) == 16
    assert slot_ranges(384, 64, 1, cuda) == 4  # batch 128
    assert slot_ranges(1024, 32, 1, cuda) == 1  # 16 heads at batch 64: whole
    assert split.split_count(1024, 32, cuda, per_sm=8) == 2
