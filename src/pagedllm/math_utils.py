"""Integer helpers shared by every layer (no torch)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for positive b: the blocks of size b that hold a items (cdiv(17, 16) == 2).

    Works for numpy integers too."""
    return -(-a // b)
