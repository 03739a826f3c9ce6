"""Evaluation of any causal LM the toolkit can load (teacher and hybrids alike): long-context retrieval,
perplexity, speed and memory, and the pictures the papers draw of the mixers' memories."""
