"""kernels/varlen.py: the chunk layout of packed sequences, exact where it counts and free of host syncs."""

import random

import torch

from raven_kernels.sila.utils import varlen_layout
from raven_kernels.varlen import chunk_layout


def random_offsets(rng: random.Random, n: int) -> torch.Tensor:
    lengths = [rng.choice([0, 1, rng.randint(1, 40), 16, 32]) for _ in range(n)]
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_real_chunks_in_order_then_spare_ones_past_the_end():
    rng = random.Random(0)
    for _ in range(50):
        cu, chunk = random_offsets(rng, rng.randint(1, 6)), rng.choice([4, 16])
        seq, pos, first, total = chunk_layout(cu, int(cu[-1]), chunk)
        lengths = cu.diff().tolist()
        exact = [(s, c) for s, n in enumerate(lengths) for c in range(-(-n // chunk))]
        assert total == -(-int(cu[-1]) // chunk) + len(lengths) >= len(exact)
        pairs = list(zip(seq.tolist(), pos.tolist()))
        assert pairs[: len(exact)] == exact
        assert all(s == len(lengths) - 1 and c * chunk >= lengths[s] for s, c in pairs[len(exact) :])
        assert first.tolist() == [sum(-(-n // chunk) for n in lengths[:i]) for i in range(len(lengths) + 1)]


def test_no_value_is_read_back_to_the_host():
    cu = torch.tensor([0, 5, 21, 21, 40], dtype=torch.int32, device="meta")  # meta tensors hold no values
    assert chunk_layout(cu, 40, 16)[3] == 7
    offsets, indices, n_states, n_chunks = varlen_layout(cu, 4, 40, 16)
    assert (n_states, n_chunks, tuple(indices.shape)) == (11, 7, (7, 2))


def test_sila_checkpoint_slots_fit_their_bound():
    rng = random.Random(1)
    for _ in range(50):
        cu, chunk = random_offsets(rng, rng.randint(1, 6)), rng.choice([4, 16])
        N = cu.numel() - 1
        offsets, _, n_states, _ = varlen_layout(cu, N, int(cu[-1]), chunk)
        slots = [-(-n // chunk) + 1 for n in cu.diff().tolist()]  # each sequence's chunks + its final state
        assert offsets.tolist() == [sum(slots[:i]) for i in range(N)]
        assert sum(slots) <= n_states
