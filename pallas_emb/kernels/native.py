"""The sparse step's CPU kernels in C++ (backend "native"), through jax.ffi.

Three operations run natively on a CPU device (the library: `native_lib`):

* `unique_keys`: dedup's sort, an LSD radix sort; a drop-in for the
  "search" core of `sharding.dedup.unique_keys` (its `impl`).
* `segment_sum_update`: one device's whole update in one pass over the rows:
  per-row sums of the token gradients, global norm and gate, optimizer math,
  written in place (the one-device step, where no gradient travels).
* `fused_update`: the optimizer update of already summed rows, in place (the
  owner side of a multi-device step); same contract as `xla.fused_update`.

The update runs for float32 tables whose optimizer names a native rule
(`native_rule()`: SGD, Adagrad, RowWiseAdagrad, LazyAdam, FTRL with
learning_rate_power -0.5 or 0; see csrc/row_rules.h). `supports` says
whether a call can run here; for any other optimizer or dtype the caller runs
the XLA path, call by call. What a rule needs of a transcendental function
(LazyAdam's bias corrections, the lazy decay of RowWiseAdagrad) XLA computes
per row, with the optimizer's own code, before the call (`per_row`).

Exactness against the XLA path, the oracle (tests/test_native.py):

* Bit for bit: the unique keys, inverse and counts; the per-row gradient sums
  (each row summed from 0.0 in token order, as XLA:CPU's scatter-add does);
  which rows change; every other row; and a skipped update (gate False or a
  non-finite norm), which leaves table and slots unchanged.
* Within a stated tolerance: the optimizer math, at most `ULP_TOLERANCE` units
  in the last place of the operands' magnitude, max(|row|, |lr * step|) for
  a row, |acc| for an accumulator. XLA:CPU reduces `jnp.mean` in an order no
  sequential, lane or tree order reproduces, and on FMA hosts contracts
  `a * b + c` into fused multiply-adds where its fusion decisions put them
  together (the tests switch that off with --xla_cpu_max_isa=AVX; training
  does not). Mirroring that bit for bit would mean redefining `update_rows`
  for every backend, the TPU kernel's included, around XLA:CPU's current code
  generation. The C++ instead rounds every operation once, in a fixed order:
  its results are deterministic, the same for any thread count, instruction
  set and CPU of its architecture. Measured with contraction off (the tests'
  setting, three steps on 1 and 4 devices): row-wise Adagrad's rows up to 4
  ulps apart (its mean), every other rule's rows and slots at most 2, and
  LazyAdam's and FTRL's slots bit for bit.
* The norm is the square root of the sum, in row order, of each row's sum of
  squares: deterministic, equal to XLA's to float32 rounding; the gate agrees
  except within rounding of float32 overflow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.errors import InputError
from pallas_emb.kernels import checks, native_lib
from pallas_emb.kernels.protocol import RowUpdate

# The bound on |native - xla| for the optimizer math that the tests hold, in
# float32 ulps of the operands' magnitude (see the module docstring).
ULP_TOLERANCE = 4

# The slots of each native rule, in the order its kernels take them, and
# their dtypes (csrc/row_rules.h: kSlotIsInt).
_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
_RULE_SLOTS = {
  "sgd": (),
  "adagrad": (("acc", _F32),),
  "rowwise_adagrad": (("acc", _F32),),
  "rowwise_adagrad_lazy": (("acc", _F32), ("last_step", _I32)),
  "lazy_adam": (("m", _F32), ("v", _F32), ("count", _I32)),
  "ftrl": (("accumulator", _F32), ("linear", _F32)),
}


def unique_keys(keys: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The distinct keys with a static capacity (`sharding.dedup.UniqueImpl`).

  Args:
    keys: (n,) int32; INT32_MAX marks an input without a key.
    capacity: static slots of the result.

  Returns:
    (keys (capacity,) ascending and INT32_MAX-padded, inverse (n,) slot of
    each input or -1, num_unique () including keys over capacity), int32,
    bit for bit those of `sharding.dedup.unique_keys(..., "search")`.
  """
  n = keys.shape[0]
  return jax.ffi.ffi_call(
    native_lib.UNIQUE_KEYS,
    (
      jax.ShapeDtypeStruct((capacity,), jnp.int32),
      jax.ShapeDtypeStruct((n,), jnp.int32),
      jax.ShapeDtypeStruct((), jnp.int32),
    ),
  )(keys)


class _Rule(NamedTuple):
  target: str  # handler name prefix
  static: tuple[float, ...]  # hyperparameters after the optimizer's scalars
  slots: tuple[str, ...]  # slot names in the kernels' order
  per_row: Callable | None  # (slot rows, scalars) -> (C, k) float32


def _rule(optimizer: RowUpdate, dtype) -> _Rule | None:
  """The native rule of `optimizer` for a `dtype` table, or None."""
  if np.dtype(dtype) != np.float32 or not native_lib.available():
    return None
  native_rule = getattr(optimizer, "native_rule", None)
  found = native_rule() if native_rule is not None else None
  if found is None:
    return None
  name, static, per_row = (tuple(found) + (None,))[:3]
  specs = optimizer.slot_specs()
  want = _RULE_SLOTS.get(name)
  if (
    want is None
    or set(specs) != {k for k, _ in want}
    or any(np.dtype(specs[k].dtype) != t for k, t in want)
  ):
    return None
  return _Rule(
    native_lib.RULE_TARGETS[name],
    tuple(float(x) for x in static),
    tuple(k for k, _ in want),
    per_row,
  )


def supports(optimizer: RowUpdate, dtype) -> bool:
  """True if the native update runs `optimizer` on a `dtype` table here."""
  return _rule(optimizer, dtype) is not None


def _scalars(rule: _Rule, scalars: NamedTuple) -> jax.Array:
  # The optimizer's scalars may be traced (a schedule, the step); the rest
  # are constants.
  return jnp.stack(
    [jnp.asarray(x, jnp.float32).reshape(()) for x in scalars]
    + [jnp.float32(x) for x in rule.static]
  )


def _per_row(rule: _Rule, optimizer: RowUpdate, slots, rows, scalars, dim) -> jax.Array:
  """(C, k) float32 values of each listed row that the rule takes from XLA
  (`native_rule`'s per_row), or (C, 0)."""
  if rule.per_row is None:
    return jnp.zeros((rows.shape[0], 0), jnp.float32)
  specs = optimizer.slot_specs()
  # Padding (-1) reads zeros; XLA drops the gathers per_row does not use.
  idx = jnp.where(rows >= 0, rows, jnp.iinfo(jnp.int32).max)
  slot_rows = {
    k: jnp.take(specs[k].values(v, dim), idx, axis=0, mode="fill", fill_value=0)
    for k, v in slots.items()
  }
  out = jnp.asarray(rule.per_row(slot_rows, scalars), jnp.float32)
  return out.reshape(rows.shape[0], -1)


def _call(
  rule: _Rule,
  kind: str,
  table,
  slots: Mapping[str, jax.Array],
  operands,
  *,
  optimizer: RowUpdate,
  dim: int,
  dtype,
  extra_results=(),
):
  names = rule.slots
  # The stored widths go with the call: the C++ never infers a row's stride
  # from the gradients, which are `dim` wide where the stored rows may be
  # padded (96 -> 128) or packed (16 -> 128-lane physical rows).
  specs = optimizer.slot_specs()
  widths = dict(
    dim=np.int64(dim),
    table_words=np.int64(checks.row_width(table, dim, dtype)),
    slot_words=np.array([specs[k].stored_width(dim) for k in names], np.int64),
  )
  # Slots go in their stored shape: a per-row scalar stored lane-dense,
  # (rows / 128, 128), has the bytes of (rows, 1) in the same order, and the
  # kernels only check its element count. A reshape here would make XLA copy
  # the slot in and out on every step (it does not alias a reshaped operand).
  # The handlers take the table, the operands, then the slots, and return the
  # table, the extra results (the norm), then the slots, aliased.
  extra = len(extra_results)
  results = (
    (jax.ShapeDtypeStruct(table.shape, table.dtype),)
    + tuple(extra_results)
    + tuple(jax.ShapeDtypeStruct(slots[k].shape, slots[k].dtype) for k in names)
  )
  first_slot = 1 + len(operands)
  aliases = {0: 0} | {first_slot + i: 1 + extra + i for i in range(len(names))}
  out = jax.ffi.ffi_call(rule.target + kind, results, input_output_aliases=aliases)(
    table, *operands, *(slots[k] for k in names), **widths
  )
  return out[0], dict(zip(names, out[1 + extra :])), out[1 : 1 + extra]


def _require(optimizer: RowUpdate, dtype) -> _Rule:
  rule = _rule(optimizer, dtype)
  if rule is None:
    raise InputError(
      f"the native update cannot run {type(optimizer).__name__} on a "
      f"{np.dtype(dtype)} table (needs float32 and a native_rule(), and the "
      f"native library: {native_lib.status().reason or 'loaded'}); check "
      "native.supports() first and use the XLA path otherwise."
    )
  return rule


def fused_update(
  table, slots, rows, grads, scalars, apply, *, optimizer, dtype, dim: int | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`xla.fused_update` in C++: the listed rows updated in place.

  Args:
    table: (R, dim) float32 stored rows, or packed (`packing.table_shape`).
    slots: name -> (R, width) float32 optimizer state.
    rows: (C,) int32 distinct local row ids, -1 for padding.
    grads: (C, dim) float32 summed gradient per row.
    scalars: `optimizer.scalars(step)`.
    apply: bool scalar; when False nothing is written.
    optimizer: one that `supports` accepts.
    dtype: the table's logical dtype (float32).
    dim: the table's row width; grads must be as wide (see
      `checks.check_update`). None: the gradients' width.

  Returns:
    (table, slots) with only the listed rows changed.
  """
  dim = checks.check_update(
    table, slots, rows, grads, scalars, optimizer=optimizer, dtype=dtype, dim=dim
  )
  rule = _require(optimizer, dtype)
  per_row = _per_row(rule, optimizer, slots, rows, scalars, dim)
  table, slots, _ = _call(
    rule,
    "RowUpdate",
    table,
    slots,
    (rows, grads, _scalars(rule, scalars), per_row, jnp.asarray(apply, jnp.bool_)),
    optimizer=optimizer,
    dim=dim,
    dtype=dtype,
  )
  return table, slots


def segment_sum_update(
  table, slots, rows, inverse, token_grads, scalars, gate, *, optimizer, dtype, dim=None
):
  """One device's sum, norm, gate and update in one pass, in place.

  Args:
    table: (R, dim) float32 stored rows, or packed (`packing.table_shape`).
    slots: name -> (R, width) float32 optimizer state.
    rows: (C,) int32 local row of each unique slot, -1 for padding; distinct.
    inverse: (n,) int32 unique slot of each token; tokens outside [0, C)
      have no row and contribute nothing.
    token_grads: (n, dim) float32 gradient per token.
    scalars: `optimizer.scalars(step)`.
    gate: bool scalar; False writes nothing.
    optimizer: one that `supports` accepts.
    dtype: the table's logical dtype (float32).
    dim: the table's row width; token_grads must be as wide. None: their
      width.

  Returns:
    (table, slots, norm): norm is the () float32 norm of the per-row sums;
    rows are written only if it is finite and `gate` is True.
  """
  dim = checks.check_stored_table(table, dtype, token_grads.shape[-1] if dim is None else dim)
  checks.check_rows(rows)
  checks.check_grads(
    token_grads,
    checks.check_rows(inverse, "inverse"),
    dim,
    name="token_grads",
    per="token of inverse",
  )
  checks.check_optimizer_state(table, slots, scalars, optimizer, dim, dtype)
  rule = _require(optimizer, dtype)
  per_row = _per_row(rule, optimizer, slots, rows, scalars, dim)
  table, slots, (norm,) = _call(
    rule,
    "SegsumUpdate",
    table,
    slots,
    (
      rows,
      inverse,
      token_grads,
      _scalars(rule, scalars),
      per_row,
      jnp.asarray(gate, jnp.bool_),
    ),
    optimizer=optimizer,
    dim=dim,
    dtype=dtype,
    extra_results=(jax.ShapeDtypeStruct((), jnp.float32),),
  )
  return table, slots, norm
