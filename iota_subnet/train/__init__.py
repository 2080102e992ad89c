"""Training: the inner optimizer, checkpoints, metrics and the co-located reference trainer."""
