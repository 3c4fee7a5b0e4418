"""Host memory tuning for XLA:CPU: freed memory kept, tables on huge pages.

`keep_freed_memory`: XLA:CPU allocates every step's temporaries afresh.
glibc's malloc serves blocks above its mmap threshold (at most 32 MiB) with
fresh mmap'd pages and unmaps them on free, so each step pays a page fault
per 4 KiB of temporaries: on the W1 update (1M x 128 rows, 65,536 ids) that
doubled the step time. XLA's worker threads also get per-thread arenas, whose
heaps glibc unmaps and maps again (33,283 faults per step at 262,144 ids).
Serving everything from one arena's heap and never trimming it removes the
faults, at the price of keeping the process's peak heap resident.

`use_huge_pages`: a sparse update reads and writes table rows in random
order; with 4 KiB pages nearly every row costs a TLB miss and a page walk
(a 10M x 128 table has 10 MB of page tables). Transparent huge pages (2 MiB)
for the table made the one-device update at V = 10M 1.6 times faster.

Both change how the process's memory is managed, so the library never calls
them on its own: the main job and the benchmark do (a training process on
CPU wants them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1+
_HUGE_PAGE = 1 << 21


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
  # No mmap'd blocks, trim the heap top only above 1 GiB free, and one arena
  # for every thread. Called before XLA's threads first allocate, the last
  # keeps their temporaries in the heap the first two tune.
  return (
    bool(mallopt(_M_MMAP_MAX, 0))
    and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    and bool(mallopt(_M_ARENA_MAX, 1))
  )


def release_free_memory() -> bool:
  """Returns free heap pages to the OS (glibc `malloc_trim`); True if done.

  For a long-lived process that kept its freed memory and now moves to
  differently sized work (the benchmark between workloads).
  """
  trim = getattr(_libc(), "malloc_trim", None)
  return bool(trim(0)) if trim is not None else False


def advise_huge_pages(address: int, nbytes: int) -> int:
  """Backs [address, address + nbytes) with transparent huge pages.

  `madvise(MADV_HUGEPAGE)` on the 2 MiB-aligned interior, so that pages
  touched later fault in as huge pages, then `MADV_COLLAPSE` of each 2 MiB
  (Linux 6.1+) to convert the pages already there; best effort: a range the
  kernel refuses keeps its pages. Collapsing copies the memory once (about a
  second for 5 GB).

  Returns:
    The bytes advised: 0 off Linux, when THP is disabled or the range has no
    whole 2 MiB page.
  """
  madvise = getattr(_libc(), "madvise", None)
  lo = (address + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
  hi = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
  if madvise is None or hi <= lo:
    return 0
  madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  if madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
    return 0
  for page in range(lo, hi, _HUGE_PAGE):
    madvise(page, _HUGE_PAGE, _MADV_COLLAPSE)
  return hi - lo


def use_huge_pages(tree, min_bytes: int = 64 << 20) -> int:
  """`advise_huge_pages` for every CPU array of `tree` of >= `min_bytes`.

  Meant for embedding tables and their slots on CPU (`ShardedEmbedding.init`'s
  state), right after init: an update that donates the state keeps the same
  buffers, so the advice lasts. Arrays on other platforms are skipped.

  Returns:
    The bytes advised.
  """
  import jax  # pylint: disable=g-import-not-at-top

  total = 0
  for leaf in jax.tree.leaves(tree):
    for shard in getattr(leaf, "addressable_shards", ()):
      data = shard.data
      if data.device.platform != "cpu" or data.nbytes < min_bytes:
        continue
      total += advise_huge_pages(data.unsafe_buffer_pointer(), data.nbytes)
  return total
