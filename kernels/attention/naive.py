"""Reference for `decode_attention`: the PyTorch form of raven_layers.decode_attention (float32 softmax over the
valid slots, each key/value head serving its group of query heads)."""

from raven_layers.decode_attention import decode_attention_torch as naive_decode_attention

__all__ = ["naive_decode_attention"]
