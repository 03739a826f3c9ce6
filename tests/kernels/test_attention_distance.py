"""attention_distance (Triton, interpreted on CPU) against its PyTorch reference: GQA and plain heads, odd lengths
and head sizes, left/right padding, packed documents (one of a single token), windows, queries with no allowed key,
masks with holes, document ids that are not runs, tau 0 and a high tau, bf16."""

from __future__ import annotations

import math

import pytest
import torch

from raven_kernels.attention import attention_distance
from raven_kernels.attention.distance import first_keys
from raven_kernels.attention.naive import naive_attention_distance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def padded(real: torch.Tensor):
    """(real, positions, documents, sinks) of padded rows: positions count real tokens, the first real one is the
    sink (as token_weights lays them out)."""
    positions = (real.long().cumsum(-1) - 1).clamp(min=0).float()
    sinks = torch.zeros_like(real).scatter(1, real.long().argmax(-1, keepdim=True), True)
    return real, positions, torch.zeros_like(real, dtype=torch.long), sinks


def packed(lengths: list[list[int]]):
    """(real, positions, documents, sinks) of rows of packed documents of the given lengths, each its own sink."""
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    starts = positions == 0
    return torch.ones_like(starts), positions.float(), starts.long().cumsum(-1) - 1, starts


def check(B, H, Hkv, d, layout, window, tau, blocks, dtype=torch.float32, seed=0):
    real, positions, documents, sinks = (x.to(DEVICE) for x in layout)
    T = real.shape[1]
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(B, T, H, d, generator=g)).to(dtype).to(DEVICE).transpose(1, 2)  # [B, H, T, d], strided
    k = (2 * torch.randn(B, Hkv, T, d, generator=g)).to(dtype).to(DEVICE)
    args = (q, k, d**-0.5, real, positions, documents, sinks, window, tau)
    got = attention_distance(*args, blocks=blocks)
    expected = naive_attention_distance(*args, query_block=16)
    assert got.shape == (B, T) and got.dtype == torch.float32 and not got.isnan().any()
    assert (expected[real] > 0).float().mean() > 0.3  # a meaningful comparison: most queries retrieve something
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    return got


def test_gqa_padding_and_empty_rows():
    """Left- and right-padded rows and a row of pads alone (no query has an allowed key: zeros, not NaN); query
    head h reads key head h // 3; an odd length and head size."""
    real = torch.ones(3, 37, dtype=torch.bool)
    real[0, :9] = False
    real[1, 30:] = False
    real[2] = False
    got = check(3, 6, 2, 24, padded(real), None, 0.2, (16, 16))
    assert torch.all(got[~real.to(DEVICE)] == 0)


@pytest.mark.parametrize(
    "H, Hkv, window, tau, blocks",
    [
        (3, 3, None, 0.2, (32, 16)),  # one key head per query head
        (4, 2, 8, 0.0, None),  # a window shorter than a block, nothing dropped, the default blocks
        (2, 1, 40, 0.6, (16, 32)),  # a window across blocks, a high threshold
    ],
)
def test_packed_documents(H, Hkv, window, tau, blocks):
    """Rows of several documents (one of a single token), each with its own sink; keys before a block's first
    document are skipped."""
    check(2, H, Hkv, 16, packed([[40, 1, 60, 29], [70, 60]]), window, tau, blocks)


def test_holes_and_documents_that_are_not_runs():
    """A mask with holes (tokens after a pad see real keys before it) and document ids that come back after another
    document: the key blocks skipped must still be those no query may see."""
    T = 130
    real = torch.ones(2, T, dtype=torch.bool)
    real[0, 20:50] = False
    real[1, :3] = False
    _, positions, _, sinks = padded(real)
    documents = (torch.arange(T) // 25 % 2).repeat(2, 1)
    documents[0] = 0
    check(2, 2, 1, 16, (real, positions, documents, sinks), None, 0.1, (16, 16))


def test_ties_at_tau_are_kept():
    """Zero queries attend uniformly: p = 1/(t + 1) from each query t of a document to its keys, exactly tau = 0.2 at
    t = 4, kept (p >= tau) without its sink; later queries fall below tau, earlier ones keep everything."""
    layout = [x.to(DEVICE) for x in packed([[10]])]
    q, k = torch.zeros(1, 1, 10, 16, device=DEVICE), torch.randn(1, 1, 10, 16, device=DEVICE)
    got = attention_distance(q, k, 0.25, *layout, None, 0.2, blocks=(16, 16))
    expected = [sum(t - j for j in range(1, t + 1)) / (t + 1) if t <= 4 else 0.0 for t in range(10)]
    torch.testing.assert_close(got[0], torch.tensor(expected, device=DEVICE))
    assert got[0, 4] > 0
    torch.testing.assert_close(got, naive_attention_distance(q, k, 0.25, *layout, None, 0.2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_blocks_too_low_for_tau_are_skipped_exactly(dtype):
    """Peaked attention (each query on the key 5 back, the other keys far below tau) over many key blocks: the
    second sweep skips the blocks where no probability can reach tau (most of them, `skipped_share`), and the sums are
    bit for bit those with every block formed, and the reference's."""
    T, d = 208, 16
    layout = [x.to(DEVICE) for x in packed([[T]])]
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 1, T, d, generator=g)
    q = 3 * k.roll(5, dims=2) + 0.5 * torch.randn(1, 2, T, d, generator=g)  # two query heads on one key head
    q, k = q.to(dtype).to(DEVICE), k.to(dtype).to(DEVICE)
    args = (q, k, d**-0.5, *layout, None, 0.2)
    assert skipped_share(q.float(), k.float(), d**-0.5, 0.2, 16) > 0.5
    skipped = attention_distance(*args, blocks=(16, 16))
    formed = attention_distance(*args, blocks=(16, 16), skip_blocks=False)
    assert torch.equal(skipped, formed)
    expected = naive_attention_distance(*args, query_block=16)
    assert (expected > 0).float().mean() > 0.8
    torch.testing.assert_close(skipped, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def skipped_share(q, k, scaling, tau, block):
    """The share of the causal (query block, key block) pairs of one row whose scores all fall below the kernel's
    floor m + log2(tau l) (its test, in PyTorch, for a row of one document of a multiple of `block` tokens)."""
    T = q.shape[2]
    scores = (q[0] @ k[0].transpose(-1, -2)) * scaling / math.log(2)  # [H, T, T] log2 units
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    masked = scores.masked_fill(~allowed, float("-inf"))
    m = masked.amax(-1, keepdim=True)
    floor = m + torch.log2(tau * torch.exp2(masked - m).sum(-1, keepdim=True))
    blocks = (scores - floor).unflatten(1, (-1, block)).unflatten(3, (-1, block)).amax((2, 4))  # [H, T/b, T/b]
    causal = torch.ones_like(blocks[0], dtype=torch.bool).tril()
    return (blocks[:, causal] < 0).float().mean().item()


def test_bf16_inputs():
    check(1, 4, 2, 32, packed([[50, 30]]), None, 0.2, (16, 16), dtype=torch.bfloat16, seed=1)


def test_first_keys_is_a_lower_bound():
    """No key before first_keys[t] is allowed to query t, and the bound is exact for runs of documents."""
    g = torch.Generator().manual_seed(0)
    T = 40
    real = torch.rand(4, T, generator=g) > 0.3
    documents = torch.randint(0, 3, (4, T), generator=g).sort(dim=1).values
    documents[3] = torch.randint(0, 3, (T,), generator=g)  # not runs
    first = first_keys(real, documents)
    idx = torch.arange(T)
    allowed = (idx[None, :] <= idx[:, None]) & real[:, None, :] & (documents[:, None, :] == documents[:, :, None])
    true_first = torch.where(allowed, idx, T).amin(-1)  # [B, T]
    assert torch.all(first <= true_first)
    assert torch.equal(first[:3][real[:3]], true_first[:3][real[:3]])


def test_bad_shapes_are_refused():
    real, positions, documents, sinks = padded(torch.ones(1, 8, dtype=torch.bool))
    q, k = torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"H a multiple of Hkv; got q \(1, 3, 8, 16\), k \(1, 2, 8, 16\)"):
        attention_distance(q, k, 0.25, real, positions, documents, sinks, None, 0.2)
    with pytest.raises(ValueError, match=r"positions has shape \(1, 7\), expected \[B, T\] = \(1, 8\)"):
        attention_distance(q[:, :2], k, 0.25, real, positions[:, :7], documents, sinks, None, 0.2)
    with pytest.raises(ValueError, match="documents must hold integer ids"):
        attention_distance(q[:, :2], k, 0.25, real, positions, positions, sinks, None, 0.2)
