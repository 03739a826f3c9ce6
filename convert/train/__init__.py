"""Distillation: layer alignment, token loss weights and continued training."""
