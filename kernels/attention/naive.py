"""References of the attention kernels, for the tests.

`naive_decode_attention`, for `decode_attention`: the PyTorch form of raven_layers.decode_attention (float32 softmax
over the valid slots, each key/value head serving its group of query heads).

`naive_attention_distance`, for `attention_distance`: one layer's thresholded attention times distance in PyTorch,
streamed over blocks of queries (distance.py's `attention_distance_torch`, which the pipeline also runs, so it lives
beside the kernel).
"""

from raven_layers.decode_attention import decode_attention_torch as naive_decode_attention

from .distance import attention_distance_torch as naive_attention_distance

__all__ = ["naive_attention_distance", "naive_decode_attention"]
