"""decode_attention (Triton, interpreted on CPU) against its PyTorch reference: GQA groups, left padding, slots
beyond the written ones never read, ranges with no valid slot, odd head sizes, bf16; under every tiling the sweep
tries (scripts/bench/sweep_decode_attention.py)."""

from __future__ import annotations

import pytest
import torch

import raven_kernels.split
from raven_kernels.attention import decode_attention
from raven_kernels.attention.decode import DecodeTiles, decode_tiles, split_config
from raven_kernels.attention.naive import naive_decode_attention
from raven_kernels.split import Partials, row_counters

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(B, Hq, Hkv, S, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, Hq, d, generator=g).to(dtype).transpose(1, 2)  # [B, Hq, 1, d], as the layers pass it
    k = torch.randn(B, Hkv, S, d, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, d, generator=g).to(dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


@pytest.mark.parametrize(
    "B, Hq, Hkv, S, d, filled",
    [
        (1, 3, 1, 37, 16, 37),  # one group of three heads, an odd buffer, every slot written
        (2, 4, 2, 200, 16, 150),  # slots past step + 1 hold garbage that must not be read
        (3, 9, 3, 130, 24, 1),  # only the new token: most ranges see no valid slot
        (2, 2, 2, 64, 64, 64),  # no grouping
        (100, 6, 3, 40, 16, 33),  # 300 rows, more than the GPU's programs: one range a row, written directly
    ],
)
@pytest.mark.parametrize(
    "tiles",
    [
        DecodeTiles(),
        DecodeTiles(block=64, stages=None, merge_in_kernel=False),  # the ranges merged by a second kernel
        DecodeTiles(block=32, per_sm=4),
        DecodeTiles(block=128, warps=8, stages=3, per_sm=1),
        DecodeTiles(block=32, per_sm=4, merge_in_kernel=True),  # several ranges a row, merged by the last
        DecodeTiles(block=16, max_ranges=2),  # fewer, longer ranges than the GPU asks for
        DecodeTiles(block=16, max_ranges=1),  # one range a row: written directly
    ],
)
def test_matches_reference(B, Hq, Hkv, S, d, filled, tiles):
    q, k, v = make(B, Hq, Hkv, S, d)
    valid = torch.zeros(B, S, dtype=torch.bool, device=DEVICE)
    valid[:, :filled] = True
    valid[0, : filled // 3] = False  # left padding of the first row
    valid[0, filled - 1] = True  # the new token is always there
    k[:, :, filled:] = float("nan")  # never written: reading them would poison the output
    v[:, :, filled:] = float("nan")
    step = torch.tensor([filled - 1], device=DEVICE)
    scale = d**-0.5
    with decode_tiles(tiles):
        out = decode_attention(q, k, v, valid, step, scale)
    ref = naive_decode_attention(q, k[:, :, :filled], v[:, :, :filled], valid[:, :filled], step, scale)
    assert out.shape == (B, 1, Hq, d) and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype, native",
    [
        (torch.bfloat16, False),
        (torch.float16, True),  # products in the cache's dtype
        pytest.param(
            torch.bfloat16,
            True,
            marks=pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter's bf16 tl.dot is wrong on CPU"),
        ),
    ],
    ids=["bf16-float32-tiles", "fp16-products", "bf16-products"],
)
def test_half_precision_within_tolerance(dtype, native):
    q, k, v = make(2, 6, 2, 96, 32, dtype=dtype, seed=1)
    valid = torch.ones(2, 96, dtype=torch.bool, device=DEVICE)
    step = torch.tensor([95], device=DEVICE)
    with decode_tiles(DecodeTiles(native=native)):
        out = decode_attention(q, k, v, valid, step, 32**-0.5)
    ref = naive_decode_attention(q, k, v, valid, step, 32**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_ranges_merged_in_kernel_leave_their_counters_at_zero_for_the_next_call():
    q, k, v = make(2, 4, 2, 200, 16, seed=3)
    valid = torch.ones(2, 200, dtype=torch.bool, device=DEVICE)
    step = torch.tensor([199], device=DEVICE)
    ref = naive_decode_attention(q, k, v, valid, step, 0.25)
    with decode_tiles(DecodeTiles(block=32, per_sm=4, merge_in_kernel=True)):
        assert split_config(4, 200, q.device, 32, 4)[0] > 1  # several ranges a row
        for _ in range(2):  # the second call counts from the zeros the first left
            torch.testing.assert_close(decode_attention(q, k, v, valid, step, 0.25), ref, atol=1e-5, rtol=1e-5)
            assert not row_counters(4, q.device).any()


def test_the_default_merges_in_the_kernel_where_a_row_fits_one_load(monkeypatch):
    """`DecodeTiles()` merges a row's ranges in its last program where they fit one load, and by a second kernel
    where a row has more: batch 1 over a long cache (128 ranges of 3 heads at 16K on an H200) would merge them one
    load after another in one program."""
    assert Partials(3, 4, 3, 64, "cpu", pad=16).row_in_one_load()  # batch 32 at 16K: 4 ranges a row
    assert not Partials(3, 128, 3, 64, "cpu", pad=16).row_in_one_load()  # batch 1 at 16K
    second, real = [], Partials.merge
    monkeypatch.setattr(Partials, "merge", lambda self, o: second.append(self.NS) or real(self, o))
    # the interpreter's 8 programs on a GPU too, so the split below is the same everywhere
    monkeypatch.setattr(raven_kernels.split, "programs_wanted", lambda device, per_sm=2: 8)
    for Hq, d, by_second_kernel in [(3, 16, False), (8, 128, True)]:  # 8 heads of 128: 4 ranges a load
        q, k, v = make(1, Hq, 1, 256, d, seed=Hq)
        valid = torch.ones(1, 256, dtype=torch.bool, device=DEVICE)
        step = torch.tensor([255], device=DEVICE)
        with decode_tiles(DecodeTiles(block=16)):
            assert split_config(1, 256, q.device, 16)[0] == 8
            out = decode_attention(q, k, v, valid, step, d**-0.5)
        torch.testing.assert_close(out, naive_decode_attention(q, k, v, valid, step, d**-0.5), atol=1e-5, rtol=1e-5)
        assert second == ([8] if by_second_kernel else [])
        second.clear()


def test_ring_buffer_full():
    """A sliding-window ring past its wrap: every slot valid, step far beyond the buffer."""
    q, k, v = make(2, 4, 2, 48, 16, seed=2)
    valid = torch.ones(2, 48, dtype=torch.bool, device=DEVICE)
    step = torch.tensor([1000], device=DEVICE)
    out = decode_attention(q, k, v, valid, step, 0.25)
    torch.testing.assert_close(out, naive_decode_attention(q, k, v, valid, step, 0.25), atol=1e-5, rtol=1e-5)


def test_split_config_covers_the_buffer():
    for rows, slots in [(1, 4096), (96, 16384), (3, 37), (512, 64)]:
        NS, chunk, block = split_config(rows, slots, torch.device("cpu"))
        assert NS >= 1 and NS * chunk >= slots and chunk % block == 0 and (NS - 1) * chunk < slots + chunk


def test_bad_shapes_are_refused():
    q, k, v = make(1, 3, 2, 16, 16)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        decode_attention(
            q, k, v, torch.ones(1, 16, dtype=torch.bool, device=DEVICE), torch.tensor([15], device=DEVICE), 0.25
        )


def test_capped_ranges_are_a_power_of_two():
    assert split_config(1, 4096, torch.device("cpu"), 16, max_ranges=2)[0] == 2  # uncapped: the programs wanted
    with pytest.raises(ValueError, match="max_ranges=3"):
        DecodeTiles(max_ranges=3)
