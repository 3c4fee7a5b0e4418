"""Host memory tuning for XLA:CPU: keep freed heap memory for the next step.

XLA:CPU allocates every step's temporaries afresh. glibc's malloc serves
blocks above its mmap threshold (at most 32 MiB) with fresh mmap'd pages and
unmaps them on free, so each step pays a page fault per 4 KiB of temporaries:
on the W1 update (1M x 128 rows, 65,536 ids) that doubled the step time.
Serving everything from the heap and never trimming it removes the faults, at
the price of keeping the process's peak heap resident.

This changes a process-wide setting, so the library never calls it on its
own: the main job and the benchmark do (a training process wants it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def _libc():
  """glibc's handle, or None off Linux/glibc."""
  name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
  if not name:
    return None
  try:
    return ctypes.CDLL(name)
  except OSError:
    return None


def keep_freed_memory() -> bool:
  """Tells glibc malloc to keep freed memory; True if it took effect.

  A no-op returning False off Linux/glibc (macOS, musl): there the allocator
  has its own policy and this module does not second-guess it.
  """
  libc = _libc()
  mallopt = getattr(libc, "mallopt", None)
  if mallopt is None:
    return False
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  # No mmap'd blocks, and trim the heap top only above 1 GiB free.
  return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def release_free_memory() -> bool:
  """Returns free heap pages to the OS (glibc `malloc_trim`); True if done.

  For a long-lived process that kept its freed memory and now moves to
  differently sized work (the benchmark between workloads).
  """
  trim = getattr(_libc(), "malloc_trim", None)
  return bool(trim(0)) if trim is not None else False
