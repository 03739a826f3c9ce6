"""Triton kernels of attention; naive.py holds the PyTorch references they are tested against.

- `decode_attention`: the kept attention layers' decode steps over a static cache (split over the slots,
  flash-decoding).
- `attention_distance`: one layer's thresholded attention times distance, summed over heads and keys (SILA's token
  weights), fused so that nothing of size T x T is stored; `attention_distance_torch` is its PyTorch form, streamed
  over blocks of queries (eager or through torch.compile), which naive.py names `naive_attention_distance`.
"""

from .decode import decode_attention
from .distance import attention_distance, attention_distance_torch, first_keys

__all__ = ["attention_distance", "attention_distance_torch", "decode_attention", "first_keys"]
