"""How the mixers' one-kernel decode steps are checked (test_sila.py, test_raven.py, test_sse.py): the same prompt
and steps on the Triton kernels and on PyTorch."""

from __future__ import annotations

import torch

from raven_layers.backend import use_backend


class TinyCache:
    """What the mixer asks of a cache: one state per layer."""

    def __init__(self):
        self.states = {}

    def get_mixer_state(self, layer_idx):
        return self.states.get(layer_idx)

    def set_mixer_state(self, layer_idx, state, num_tokens):
        self.states[layer_idx] = state


def steps_on_both_backends(mixer, padded: bool, device) -> dict[str, tuple[torch.Tensor, ...]]:
    """Two rows of 9 tokens (hidden size 32; with `padded`, row 1's token 6 is padding): 5 prefilled, then one at a
    time, without gradients, on the Triton kernels and on PyTorch: {backend: (outputs [2, 9, 32], *final state)}.
    The Triton steps keep the cache's state tensors (updated where they lie), the PyTorch ones replace them."""
    x = torch.randn(2, 9, 32, device=device)
    padding = torch.ones(2, 9, dtype=torch.bool, device=device)
    if padded:
        padding[1, 6] = False
    runs = {}
    for backend in ("triton", "torch"):
        cache = TinyCache()
        with torch.no_grad(), use_backend(backend):
            steps = [mixer(x[:, :5], cache=cache, padding_mask=padding[:, :5])[0]]
            state = cache.states[0]
            for t in range(5, 9):
                steps.append(mixer(x[:, t : t + 1], cache=cache, padding_mask=padding[:, t : t + 1])[0])
                assert all(a is b for a, b in zip(cache.states[0], state)) == (backend == "triton")
        runs[backend] = (torch.cat(steps, 1), *cache.states[0])
    return runs
