"""Where one update step's time goes: a per-stage profile on CPU.

For the benchmark (`bench.py`), one table on one device, the step it times
(`apply_gradients(plan(ids), grads)`, donated):

* backend "native": the plan (dedup: the native unique keys and the routing
  glue in XLA) is timed as its own jitted call; the update is one native
  pass whose phases the library times itself (`native_lib.profiling`):
  grouping the tokens by row, the segment sum, the row update (read row and
  slots, optimizer math, write back, undo log) and the norm and gate. "other"
  is the step's time outside these (dispatch, XLA glue).
* backend "xla": each stage is its own jitted call on the step's data: dedup
  (the plan), segment sum, norm, gather of rows and slots, the optimizer math
  (`update_rows`), and the write-back (the fused update's time less its
  gather and math). Stages that XLA fuses in the step cost less there, so
  they add up to about the step, not exactly.

Every figure is the median over the profiled steps, in milliseconds, after
one round that compiles; the stages run interleaved, step by step, like the
benchmark's methods.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import packing, stored_rows
from pallas_emb.kernels import native_lib
from pallas_emb.kernels import xla as xla_kernels
from sharding import sorted_sums


def _timed(fn: Callable[[], object]) -> float:
  tic = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - tic


def _medians(samples: dict[str, list[float]]) -> dict[str, float]:
  # The first round compiled the stages' jitted calls: it is not counted.
  return {k: float(np.median(v[1:])) * 1e3 for k, v in samples.items()}


def native_stages(
  step: Callable[[], object], plan: Callable[[], object], steps: int
) -> dict[str, float]:
  """Stages of a native step.

  Args:
    step: runs one whole step (plan and update) and returns its result.
    plan: runs the step's plan alone.
    steps: profiled steps.
  """
  samples: dict[str, list[float]] = {}
  with native_lib.profiling():
    for _ in range(steps + 1):
      whole = _timed(step)
      phases = native_lib.last_profile()
      dedup = _timed(plan)
      update = {k: v / 1e3 for k, v in phases.items() if not k.startswith("unique_")}
      row = {
        "dedup": dedup,
        "dedup.native_unique_keys": (phases["unique_sort"] + phases["unique_outputs"]) / 1e3,
        **update,
        "other": max(whole - dedup - sum(update.values()), 0.0),
        "step": whole,
      }
      for k, v in row.items():
        samples.setdefault(k, []).append(v)
  return _medians(samples)


def xla_stages(
  emb, shared, ids: jax.Array, grads: jax.Array, step: Callable[[], object], steps: int
) -> dict[str, float]:
  """Stages of an XLA step of the one-table, one-feature `emb`.

  Args:
    emb: a one-device `ShardedEmbedding` with one table and one "sum"
      feature of bags of one id, on backend "xla".
    shared: holds the state in `.state`; the step and the write-back stage
      donate it and put the result back (the benchmark times speed, not
      training, so the extra updates do not matter).
    ids: the step's (N, 1) ids; grads: its (N, D) gradients.
    step: runs one whole step.
    steps: profiled steps.
  """
  (spec,) = emb.tables
  name = spec.name
  (feature,) = emb.features_of(name)
  opt = spec.optimizer
  plan = jax.jit(lambda i: emb.plan({feature.name: i})[name])
  res = plan(ids)
  # One device: the send slots are the owner rows (`route.is_identity`), so
  # the update's segment sum is by `token_slot` straight into them (in the
  # dedup's sorted order where it sorted, as `route.to_owners` sums).
  rows, inverse = res.plan.owner_rows, res.plan.token_slot
  capacity = rows.shape[0]

  @jax.jit
  def segment_sum(g, inv, in_order):
    return sorted_sums.segment_sum(g, inv, capacity, in_order)

  sums = segment_sum(grads, inverse, res.plan.token_sums)

  @jax.jit
  def norm(x):  # the update's overflow-safe norm, less its collectives
    peak = jnp.max(jnp.abs(x), initial=0.0)
    scale = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(peak, jnp.uint32) & jnp.uint32(0x7F800000), jnp.float32
    )
    scale = jnp.where(jnp.isfinite(peak) & (scale > 0), scale, 1.0)
    return scale * jnp.sqrt(jnp.sum((x / scale) ** 2))

  @jax.jit
  def gather(table, slots, r):
    # Narrow rows and per-row scalars are stored packed: read sub-rows; an
    # index past every array's end reads zeros.
    idx = jnp.where(r >= 0, r, jnp.int32(2**30))
    width = packing.storage_width(spec.dim, spec.dtype)
    specs = opt.slot_specs()
    return packing.unpack_rows(stored_rows.take_rows(table, idx, width), spec.dtype, spec.dim), {
      k: specs[k].values(stored_rows.take_rows(v, idx, specs[k].stored_width(spec.dim)), spec.dim)
      for k, v in slots.items()
    }

  math = jax.jit(lambda r, s, g, st: opt.update_rows(r, s, g, opt.scalars(st)))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def fused(table, slots, r, g, st):
    return xla_kernels.fused_update(
      table, slots, r, g, opt.scalars(st), jnp.bool_(True), optimizer=opt, dtype=spec.dtype
    )

  def write_back():
    s = shared.state[name]
    table, slots = fused(s.table, s.slots, rows, sums, s.step)
    shared.state = {name: s._replace(table=table, slots=slots)}
    return table

  samples: dict[str, list[float]] = {}
  for _ in range(steps + 1):
    got = {
      "step": _timed(step),
      "dedup": _timed(lambda: plan(ids)),
      "segment_sum": _timed(lambda: segment_sum(grads, inverse, res.plan.token_sums)),
      "norm": _timed(lambda: norm(sums)),
    }
    s = shared.state[name]
    got["gather"] = _timed(functools.partial(gather, s.table, s.slots, rows))
    gathered = gather(s.table, s.slots, rows)
    got["update_rows"] = _timed(functools.partial(math, *gathered, sums, s.step))
    del s, gathered  # the write-back donates the table: hold no reference to it
    whole_update = _timed(write_back)
    got["write_back"] = max(whole_update - got["gather"] - got["update_rows"], 0.0)
    known = sum(v for k, v in got.items() if k != "step")
    got["other"] = max(got["step"] - known, 0.0)
    for k, v in got.items():
      samples.setdefault(k, []).append(v)
  return _medians(samples)
