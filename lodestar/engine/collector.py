"""Python's cyclic garbage collector held off around work that must not be interrupted by a
collection, or that allocates so much that repeated collections would dominate it."""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def paused():
    """No cyclic collection inside the block; the collector's state is restored after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
