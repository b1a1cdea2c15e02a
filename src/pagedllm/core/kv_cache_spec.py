"""KV cache specs per layer group: which layers share a block table, and how one pool's memory serves them all.

Every attention layer has a spec: full attention (window 0, it keeps every token's K/V) or a sliding window of W
tokens (the query at position p reads keys at positions > p - W, so blocks wholly before p - W + 1 can go). Layers
with the same spec are cut into groups of `group_size` layers (vLLM's hybrid layout): each group has its own block
table, and a physical block holds `group_size` layers' pages, so block b of tensor j is layer j of whichever group
owns block b. Gemma 3 270M: 15 sliding layers and 3 full ones -> group_size 3, five sliding groups and one full
group; a block is 3 layers' K/V, and an 8k-token request holds 8k / block_size blocks in the full group but about
W / block_size in each sliding group.

A model whose layers are all full attention has one group of every layer: the layout of a plain paged KV cache
(core/kv_cache_manager.py serves it). Any window gives the hybrid manager (core/kv_cache_coordinator.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group of layers with the same attention: `window` 0 is full attention, else a sliding window."""

    window: int
    layers: tuple[int, ...]  # global layer indices, ascending


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups, and how many layers' pages one block holds (`group_size`: the pool's tensor count)."""

    groups: tuple[KVCacheGroupSpec, ...]
    group_size: int

    @property
    def is_hybrid(self) -> bool:
        """Some group slides: the hybrid manager frees blocks outside its window."""
        return any(group.window > 0 for group in self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def layer_group(self, layer: int) -> int:
        """The group of global layer `layer`."""
        return self._placement()[layer][0]

    def layer_tensor(self, layer: int) -> int:
        """Which of the pool's `group_size` tensors holds global layer `layer` (its index inside its group)."""
        return self._placement()[layer][1]

    def _placement(self) -> dict[int, tuple[int, int]]:
        placement = self.__dict__.get("_placement_cache")
        if placement is None:
            placement = {layer: (g, j) for g, group in enumerate(self.groups) for j, layer in enumerate(group.layers)}
            object.__setattr__(self, "_placement_cache", placement)
        return placement


def make_kv_cache_layout(layer_windows: Sequence[int]) -> KVCacheLayout:
    """Group layers by window (0: full attention), in order of first appearance, into groups of the smallest
    type's count, as vLLM does (a type whose count it does not divide ends with a smaller group).

    Example: windows [32, 32, 0, 32, 32, 0] -> types {32: [0, 1, 3, 4], 0: [2, 5]}, group_size 2, groups
    (32: [0, 1]), (32: [3, 4]), (0: [2, 5])."""
    if not layer_windows:
        raise ValueError("a model without attention layers has no KV cache layout")
    by_window: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(max(int(window or 0), 0), []).append(layer)
    group_size = min(len(layers) for layers in by_window.values())
    groups = tuple(KVCacheGroupSpec(window, tuple(layers[i:i + group_size]))
                   for window, layers in by_window.items() for i in range(0, len(layers), group_size))
    return KVCacheLayout(groups, group_size)


def single_group_layout(num_layers: int) -> KVCacheLayout:
    """Every layer full attention, one group: the plain paged layout."""
    return make_kv_cache_layout([0] * num_layers)
