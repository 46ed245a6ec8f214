"""The start-up heap freeze the server and the benchmarks use (in a child process: a freeze inside
pytest's would move every test's objects out of the collector's reach)."""

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import gc
    from specserve.engine.heap import freeze_startup_heap

    keep = [[i] for i in range(1000)]  # tracked container objects, alive across the freeze
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() >= len(keep), (frozen, gc.get_freeze_count())
    walked = {id(o) for o in gc.get_objects()}  # frozen objects are in no generation a collection walks
    assert all(gc.is_tracked(x) and id(x) not in walked for x in keep)
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    print("ok")
""")


def test_freeze_moves_live_objects_out_of_the_collectors_generations():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
