"""The start-up heap is frozen out of the garbage collector's reach, as vLLM's freeze_gc_heap does.

A full (generation 2) collection walks every tracked object: in a server process that holds a model, its modules
and tokenizer, one took ~0.1-0.2 s of the thread that triggered it. A request with a 200 KB JSON schema allocates
enough containers to trigger one, which stalled every other stream for that long (a neighbour's longest gap
0.16-0.19 s, 0.05 s with the collector off: benchmarks/structured_outputs_mask_cost.py). After start-up those
objects live until exit; frozen, later collections walk only what requests allocate.
"""

from __future__ import annotations

import gc


def freeze_gc_heap() -> None:
    """Collect what start-up left behind, then move every surviving object to the permanent generation."""
    gc.collect()
    gc.freeze()
