"""freeze_gc_heap: what start-up left is collected, and what survives is out of later collections' reach."""

from __future__ import annotations

import gc

from pagedllm.gc_heap import freeze_gc_heap


def test_the_start_up_heap_is_frozen():
    class Cycle:
        pass

    garbage = Cycle()
    garbage.me = garbage
    survivor = [object() for _ in range(10)]
    del garbage
    try:
        freeze_gc_heap()
        assert gc.get_freeze_count() >= len(survivor)
        assert not any(type(o).__name__ == "Cycle" for o in gc.get_objects())  # collected before the freeze
    finally:
        gc.unfreeze()
