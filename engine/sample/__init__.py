"""Sampling: one step's sampling inputs as tensors, and the batched sampler."""
