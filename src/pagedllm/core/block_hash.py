"""Prefix-cache block hashes: SHA-256 chained over full blocks of token ids.

A block's hash commits to everything before it: hash(block i) = SHA-256(hash(block i-1) || encoding of
block i's token ids || extra keys). Block 0's parent is `NONE_HASH`, a fixed seed, so hashes are stable
across processes and restarts (never Python's `hash()`, never pickle). `cache_salt` is an extra key of
block 0 only; because every later hash chains through block 0, two salts never share a block. A LoRA adapter's
name is an extra key of block 0 likewise (vLLM keys blocks by lora_name): requests of different adapters, or of an
adapter and the base model, never share a block; requests of the same adapter do.

Byte encoding of one block (all integers little-endian):
    parent hash (32 bytes) | b"T" | uint32 token count | int64 per token | extra keys
    extra key "salt": b"S" | uint32 byte length | UTF-8 bytes
    extra key "LoRA": b"L" | uint32 byte length | UTF-8 bytes of the adapter's name (after the salt)
Worked example with block_size 2 and prompt [7, 8, 9]: only [7, 8] is full, so one hash
    SHA-256(NONE_HASH + b"T" + pack("<I", 2) + pack("<2q", 7, 8)); token 9 is hashed once 10 arrives.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""A 32-byte SHA-256 digest identifying a full block and everything before it."""

NONE_HASH: BlockHash = hashlib.sha256(b"pagedllm prefix cache v1").digest()
"""The parent of every request's first block."""

_U32 = struct.Struct("<I")


def _encode_extra_keys(cache_salt: str | None, lora_name: str | None = None) -> bytes:
    out = b""
    if cache_salt is not None:
        salt = cache_salt.encode("utf-8")
        out = b"S" + _U32.pack(len(salt)) + salt
    if lora_name is not None:
        name = lora_name.encode("utf-8")
        out += b"L" + _U32.pack(len(name)) + name
    return out


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: Sequence[int], cache_salt: str | None = None, lora_name: str | None = None
) -> BlockHash:
    """Hash one full block.

    Args:
        parent_hash: the previous block's hash, or NONE_HASH for the first block.
        token_ids: this block's token ids (non-negative, below 2**63).
        cache_salt: the request's salt for its first block; None for every later block.
        lora_name: the request's LoRA adapter for its first block; None for every later block (or no adapter).

    Returns:
        The block's 32-byte digest.
    """
    n = len(token_ids)
    h = hashlib.sha256(parent_hash)
    h.update(b"T" + _U32.pack(n) + struct.pack(f"<{n}q", *token_ids))
    if cache_salt is not None or lora_name is not None:
        h.update(_encode_extra_keys(cache_salt, lora_name))
    return h.digest()


def append_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
    lora_name: str | None = None,
) -> None:
    """Extend `block_hashes` in place with the hashes of blocks that became full.

    Only full blocks are hashed; call again as tokens arrive. Costs one SHA-256 per new full block.

    Args:
        block_hashes: hashes computed so far for `token_ids` (one per full block), extended in place.
        token_ids: every token of the request so far (prompt + outputs).
        block_size: tokens per block.
        cache_salt: the request's salt; enters block 0's hash only.
        lora_name: the request's LoRA adapter (None: the base model); enters block 0's hash only.
    """
    num_full_blocks = len(token_ids) // block_size
    start = len(block_hashes)
    if start >= num_full_blocks:
        return
    parent = block_hashes[-1] if block_hashes else NONE_HASH
    pack = struct.Struct(f"<{block_size}q").pack
    header = b"T" + _U32.pack(block_size)
    sha256 = hashlib.sha256
    for i in range(start, num_full_blocks):
        h = sha256(parent)
        h.update(header + pack(*token_ids[i * block_size:(i + 1) * block_size]))
        if i == 0 and (cache_salt is not None or lora_name is not None):
            h.update(_encode_extra_keys(cache_salt, lora_name))
        parent = h.digest()
        block_hashes.append(parent)
