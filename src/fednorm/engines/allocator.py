"""Keep freed memory in the process, so a training step reuses the previous step's buffers.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves every block above its mmap
threshold (at most 32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` when freed, so a
model with large weights (the digit CNN's 6,272 x 2,048 linear layer is 51 MB, AlexNet's first
linear layer 151 MB) gets new pages for its gradients and temporaries at every step, and the kernel
zero-fills them page by page (minor page faults, system time). At small batches, where a step is
little compute and much memory traffic, that is a large share of the step: one-thread AlexNet at
B = 2 on 64 x 64 spent half its time in the kernel (benchmarks/performance.md, "Allocator").

:func:`reuse_freed_memory` tells glibc (``mallopt``) never to use ``mmap`` for a block and never to
trim the heap, so freed blocks stay mapped and the next step's allocations reuse them without page
faults. The process's resident memory then stays at its high-water mark instead of shrinking
between steps; the peak is unchanged up to fragmentation. Off (``federation.reuse_freed_memory:
false``) restores glibc's limits. Preloading jemalloc or tcmalloc (``LD_PRELOAD``, what Intel's
PyTorch tuning guide recommends) is the alternative with the same aim; it needs the library installed
and the variable set before the process starts, which a config option cannot do.

Results are bit-identical either way: only where the memory comes from changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# glibc's defaults for those two (malloc/malloc.c: DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX)
_DEFAULT_TRIM_THRESHOLD = 128 * 1024
_DEFAULT_MMAP_MAX = 65536
# mallopt takes a C int: the largest trim threshold it accepts (2 GiB - 1)
_NEVER_TRIM = 2**31 - 1


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's glibc, or None elsewhere (musl, macOS, Windows: nothing to tune)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def allocator_tunable() -> bool:
    """True where :func:`reuse_freed_memory` has an effect (Linux with glibc)."""
    return _glibc() is not None


def reuse_freed_memory(enabled: bool = True) -> bool:
    """Keep (``enabled``) or return (off: glibc's defaults) large freed blocks; process-wide.

    Returns True when the setting was applied, False where the C library is not glibc. Setting any of
    these also fixes glibc's otherwise self-adjusting mmap threshold, as ``mallopt`` always does.
    """
    libc = _glibc()
    if libc is None:
        return False
    mmap_max, trim = (0, _NEVER_TRIM) if enabled else (_DEFAULT_MMAP_MAX, _DEFAULT_TRIM_THRESHOLD)
    if not (libc.mallopt(M_MMAP_MAX, mmap_max) and libc.mallopt(M_TRIM_THRESHOLD, trim)):
        raise OSError("mallopt refused the allocator setting; set federation.reuse_freed_memory: false")
    return True
