"""Pieces of the sampler: per-step metadata, logits processors and logprobs. `layers.sampler` ties them up."""
