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


def test_split_count_covers_the_gpu_and_ravens_ranges_stream_2_to_8_blocks(monkeypatch):
    """Rows x ranges reach the wanted programs (a power of 2, at most the blocks). Raven's decode splits each head's
    slots into ranges of 8 blocks and two ranges at least, shorter (down to 2 blocks) only where the rows would leave
    an SM fewer than 2 programs: on an H200 the fastest of sweep_raven_decode.py's at 3 heads (M = 256: 16 ranges at
    batch 1, 4 at 32 and 128; M = 64: 4 at batch 1 and 32, 2 at 128)."""
    from raven_kernels import split
    from raven_kernels.raven.fused_recurrent import slot_ranges

    monkeypatch.setattr(split, "programs_wanted", lambda device, per_sm=2: 132 * per_sm)  # an H200's SMs
    cuda = torch.device("cuda")
    assert split.split_count(96, 64, cuda, per_sm=2) == 4
    assert split.split_count(3, 64, cuda, per_sm=2) == 64  # at most the blocks
    assert split.split_count(1024, 32, cuda, per_sm=8) == 2
    assert slot_ranges(3, 32, 1, cuda) == 16  # batch 1 at 3 heads (M = 256, 8-slot blocks): 2 blocks a range
    assert slot_ranges(96, 32, 1, cuda) == 4  # batch 32: 8 blocks a range
    assert slot_ranges(384, 32, 1, cuda) == 4  # batch 128
    assert slot_ranges(1024, 32, 1, cuda) == 4  # 16 heads at batch 64: still 8 blocks a range
    assert slot_ranges(3, 8, 1, cuda) == 4 and slot_ranges(96, 8, 1, cuda) == 4  # M = 64 (the recipe's)
    assert slot_ranges(384, 8, 1, cuda) == 2  # batch 128 at M = 64: two ranges of 4 blocks, not one of 8
    assert slot_ranges(3, 3, 1, cuda) == 1 and slot_ranges(3, 1, 1, cuda) == 1  # too few blocks to split
