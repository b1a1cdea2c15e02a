"""Speculative decoding: proposers that guess draft tokens, and the bookkeeping of what the target accepted."""
