"""Triton kernels for the mixers (one sub-package per mixer, each op beside its `naive.py` reference).

Not Hugging Face's `kernels` package: transformers resolves the import name `kernels` to this distribution
(`raven-hybrid`), whose version lies outside the range it accepts for its own hub-kernels integration.
"""
