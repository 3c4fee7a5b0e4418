"""Which form runs a table's gather and fused update: a cost model.

Two forms of each operation, with the same results bit for bit:

* "block": the block sweep kernels (`block_update`, `block_gather`): the
  table blocks that hold ids stream through VMEM, one DMA per block, and
  each id's row moves inside VMEM. Its time is the sweep (the bytes of the
  blocks holding ids, through HBM) plus a few vector loads and stores per
  id that is there; padding costs nothing.
* "xla": XLA's own gather and scatter (`kernels.xla`), row by row. Its
  time follows the ids' *capacity* (a padding slot costs what a row costs)
  and, on a TPU, grows with the table: the same scatter into a 1M-row table
  costs over twice what it costs into a 100k-row one.

On a TPU the model below picks, per table and step shape, from static
shapes only. Its constants were fitted to steps measured on one v5e chip
(the device tool, forms interleaved in one process;
docs/benchmarks/forms_v5e.json): there it picks the block update for 1M-row
shards at W-TPU's batch (the step at 0.74x the XLA path's at float32
D=128), and XLA's for 100k rows (where the block form's per-id work costs
more than XLA's scatter into a small table) and 4M rows (where the sweep
does). A packed table's XLA update copies the whole table and its slots
(temp that follows the table, not the ids), which the model charges: such
tables take the block update. The block gather, measured, never beat XLA's
gather at these shapes, so the lookup takes XLA's. On other TPU generations the same
constants are used; their choice there is unmeasured.

`PALLAS_EMB_FORMS` ("block" or "xla") forces one form for a whole process,
for benchmarks that compare them; "auto" (or unset) lets the model pick.
The interpreter ("interpret" backend) always runs the kernels: that is how
they are tested.
"""

from __future__ import annotations

import contextlib
import math
import os

from pallas_emb.errors import ConfigError

ENV_VAR = "PALLAS_EMB_FORMS"
FORMS = ("auto", "block", "xla")

# One v5e chip (docs/benchmarks/forms_v5e.json), per capacity slot of a
# step of W-TPU's shape (86,016 slots, about 37,000 of them ids):
SWEEP_BYTES_PER_S = 450e9  # a BlockSpec sweep (2.17 ms for 2 x 488 MiB)
# The block update's per-id work (its rows into a tile and back, the math):
# 4.85 ms a step for an unpacked table, 5.8 ms for a packed one. It overlaps
# the sweep's DMAs but for OVERLAP_LOSS of the smaller of the two.
BLOCK_UPDATE_SLOT_S = 56e-9
BLOCK_UPDATE_PACKED_SLOT_S = 67e-9
OVERLAP_LOSS = 0.35
# The block gather (measured before its ids were unrolled: an upper bound).
BLOCK_GATHER_SLOT_S = 24e-9
BLOCK_GATHER_PACKED_SLOT_S = 54e-9
# XLA's update (gather, math, scatter) per slot: 42 ns into a 100k x 128
# float32 table, 108 ns into 1M rows and about as much into 4M: its cost
# grows with the table's bytes up to XLA_SATURATION, and a packed table's
# scatter (words added per lane) costs more.
XLA_UPDATE_SLOT_S = 42e-9
XLA_UPDATE_PACKED_SLOT_S = 70e-9
XLA_UPDATE_GROWTH_S = 66e-9
XLA_GATHER_SLOT_S = 10e-9
XLA_GATHER_PACKED_SLOT_S = 18e-9
XLA_GATHER_GROWTH_S = 10e-9
REF_BYTES = 50e6
XLA_SATURATION = 512e6

_forced: list[str] = []


def forced() -> str:
  """The form forced by `forcing` or `PALLAS_EMB_FORMS` ("auto": none)."""
  value = _forced[-1] if _forced else os.environ.get(ENV_VAR, "auto") or "auto"
  if value not in FORMS:
    raise ConfigError(f"{ENV_VAR} must be one of {FORMS}, got {value!r}; unset it for 'auto'.")
  return value


@contextlib.contextmanager
def forcing(form: str):
  """Programs traced inside run `form` ("block", "xla" or "auto") wherever
  the backend lets them choose (a benchmark's side-by-side forms)."""
  if form not in FORMS:
    raise ConfigError(f"form must be one of {FORMS}, got {form!r}.")
  _forced.append(form)
  try:
    yield
  finally:
    _forced.pop()


def _growth(table_bytes: int) -> float:
  """0 at REF_BYTES or less, 1 from XLA_SATURATION, log-linear between."""
  span = math.log2(XLA_SATURATION / REF_BYTES)
  return min(1.0, max(0.0, math.log2(max(table_bytes, 1) / REF_BYTES) / span))


def sweep_bytes(array_bytes: int, num_rows: int, num_ids: int, block_rows: int) -> float:
  """Bytes of one array that a sweep of `num_ids` ids moves one way: its
  blocks holding ids, all of them once ids outnumber blocks."""
  blocks = max(1, -(-num_rows // block_rows))
  return array_bytes * min(1.0, num_ids / blocks)


def _overlapped(sweep: float, work: float) -> float:
  return max(sweep, work) + OVERLAP_LOSS * min(sweep, work)


def update_costs(
  *, array_bytes: list[int], num_rows: int, num_ids: int, block_rows: int, packed: bool
) -> dict[str, float]:
  """Modelled seconds of each update form on one shard.

  Args:
    array_bytes: the stored bytes of the table and of each slot.
    num_rows: the shard's rows.
    num_ids: the update's id capacity (rows listed, padding included).
    block_rows: the block form's block.
    packed: the table is stored packed (narrow rows).
  """
  swept = sum(sweep_bytes(b, num_rows, num_ids, block_rows) for b in array_bytes)
  work = num_ids * (BLOCK_UPDATE_PACKED_SLOT_S if packed else BLOCK_UPDATE_SLOT_S)
  slot = XLA_UPDATE_PACKED_SLOT_S if packed else XLA_UPDATE_SLOT_S
  xla = num_ids * (slot + XLA_UPDATE_GROWTH_S * _growth(sum(array_bytes)))
  if packed:
    # XLA's scatter into a packed table or slot copies all of it (a table's
    # worth of temp per step: 252 MiB per v5e chip for the example
    # configuration's 1M-row tables at 256 examples per chip), read and
    # written: never cheaper than a sweep.
    xla += 2 * sum(array_bytes) / SWEEP_BYTES_PER_S
  return {"block": _overlapped(2 * swept / SWEEP_BYTES_PER_S, work), "xla": xla}


def gather_costs(
  *, table_bytes: int, num_rows: int, num_ids: int, block_rows: int, packed: bool
) -> dict[str, float]:
  """Modelled seconds of each gather form (ids ascending) on one shard."""
  swept = sweep_bytes(table_bytes, num_rows, num_ids, block_rows)
  work = num_ids * (BLOCK_GATHER_PACKED_SLOT_S if packed else BLOCK_GATHER_SLOT_S)
  slot = XLA_GATHER_PACKED_SLOT_S if packed else XLA_GATHER_SLOT_S
  xla = num_ids * (slot + XLA_GATHER_GROWTH_S * _growth(table_bytes))
  return {"block": _overlapped(swept / SWEEP_BYTES_PER_S, work), "xla": xla}


def pick(costs: dict[str, float]) -> str:
  """The forced form, or the cheaper one ("xla" on a tie)."""
  mode = forced()
  if mode != "auto":
    return mode
  return "block" if costs["block"] < costs["xla"] else "xla"
