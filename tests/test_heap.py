"""The start-up heap freeze the server and the benchmarks use."""

import gc

from specserve.engine.heap import freeze_startup_heap


def test_freeze_moves_live_objects_out_of_the_collectors_generations():
    keep = [[i] for i in range(1000)]  # tracked container objects, alive across the freeze
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(keep)
        # frozen objects are in no generation a collection walks
        walked = {id(o) for o in gc.get_objects()}
        assert all(gc.is_tracked(x) and id(x) not in walked for x in keep)
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
