"""The C heap of this process: giving freed memory back to the system (glibc only; a no-op elsewhere).

PyTorch's CPU tensors come from ``malloc``. glibc serves a request above its mmap threshold with a
mapping of its own, returned to the system when freed; below it, from the heap, where freed memory
stays resident until ``malloc_trim`` hands it back. The threshold rises on its own (up to 32 MB) as
large blocks are freed, so after the first update a model's activations, gradients and optimizer
moments (a few MB each for a 135M model) all come from the heap, and the holes they leave stay
resident: measured on the default job's update, keeping blocks mapped lowered the peak by 0.7 GiB
(docs/benchmarks/memory.md).

:func:`keep_large_blocks_mapped` fixes the threshold (no rising), so every block of at least
``MMAP_THRESHOLD_BYTES`` is a mapping of its own and goes back to the system when it is freed;
:func:`trim` hands back what the heap holds free. Neither changes a computed value.

This module knows nothing of torch, models or runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number (malloc.h)."""
MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks of 1 MiB and more are mappings of their own (a 576 x 576 float32 matrix is 1.3 MB)."""


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def keep_large_blocks_mapped(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every ``malloc`` of at least ``threshold_bytes`` by a mapping of its own, from now on
    (glibc's ``mallopt(M_MMAP_THRESHOLD)``, which also stops the threshold rising); False where
    there is no glibc. An explicit ``MALLOC_MMAP_THRESHOLD_`` in the environment is left alone."""
    import os

    libc = _libc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)))


def trim() -> bool:
    """Hand the heap's free memory back to the system (glibc's ``malloc_trim(0)``); False where
    there is no glibc or nothing was released."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
