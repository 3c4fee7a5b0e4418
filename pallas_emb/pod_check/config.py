"""A model's own tables and features as a `pod_check` workload.

Two ways in, one result (a `compile.Workload`, whose step `compile_step`
compiles with the ranking MLP of the main job on top):

* `workload_from_specs`: the `TableSpec`s and `FeatureSpec`s a model passes
  to `ShardedEmbedding`, plus each feature's bag size;
* `load`: the same from a JSON file (`python -m pallas_emb.pod_check
  --config=model.json`), e.g.

      {"examples_per_chip": 4096, "num_dense": 13,
       "tables": {
         "user": {"rows": 2000000, "dim": 64, "dtype": "bfloat16",
                  "optimizer": {"name": "lazy_adam", "learning_rate": 0.001},
                  "stochastic_rounding": true},
         "item": {"rows": 1000000, "dim": 32, "optimizer": "adagrad"},
         "country": {"rows": 256, "dim": 16, "optimizer": "sgd"}},
       "features": {
         "user": {"table": "user"},
         "history": {"table": "item", "bag": 20, "combiner": "mean"},
         "country": {"table": "country"}}}

A table takes `TableSpec`'s fields by name (`rows` is `num_rows`). An
optimizer is a name, or an object with a name and the optimizer's arguments
(its defaults otherwise: the learning rate does not change what compiles). A
feature reads one table, `bag` ids per example (default 1), pooled by
`combiner` (default "sum"; null keeps the sequence).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

import jax.numpy as jnp

from pallas_emb import optimizers
from pallas_emb.data.base import FeatureInfo
from pallas_emb.errors import ConfigError
from pallas_emb.pod_check.compile import Workload
from pallas_emb.spec import FeatureSpec, TableSpec

OPTIMIZERS = {
  "sgd": optimizers.SGD,
  "adagrad": optimizers.Adagrad,
  "rowwise_adagrad": optimizers.RowWiseAdagrad,
  "lazy_adam": optimizers.LazyAdam,
  "ftrl": optimizers.FTRL,
}
# TableSpec fields a file may set (besides rows); the rest are code.
TABLE_KEYS = (
  "dim",
  "dtype",
  "optimizer",
  "layout",
  "placement",
  "unique_capacity",
  "route_capacity",
  "max_grad_norm",
  "stochastic_rounding",
  "rounding_seed",
)
FEATURE_KEYS = ("table", "bag", "combiner")
TOP_KEYS = ("tables", "features", "examples_per_chip", "num_dense", "hidden", "stacking")


def workload_from_specs(
  tables: Sequence[TableSpec],
  features: Sequence[FeatureSpec],
  bag_sizes: Mapping[str, int] | None = None,
  *,
  name: str = "config",
  examples_per_chip: int = 4096,
  num_dense: int = 0,
  hidden: Sequence[int] = (128, 64),
  stacking="auto",
) -> Workload:
  """The workload of a model's embedding specs.

  Args:
    tables, features: what the model passes to `ShardedEmbedding`.
    bag_sizes: feature name -> ids per example (default 1 each).
    examples_per_chip: the batch is this times the topology's chip count.
    num_dense, hidden: the dense inputs and MLP widths on top.
    stacking: `ShardedEmbedding.stacking`.
  """
  by_name = {t.name: t for t in tables}
  bag_sizes = dict(bag_sizes or {})
  unknown = sorted(set(bag_sizes) - {f.name for f in features})
  if unknown:
    raise ConfigError(f"bag_sizes names features {unknown} that are not among the features.")
  infos = []
  for f in features:
    if f.table not in by_name:
      raise ConfigError(
        f"feature {f.name!r} reads table {f.table!r}, which is not among the tables "
        f"{sorted(by_name)}."
      )
    bag = bag_sizes.get(f.name, 1)
    if isinstance(bag, bool) or not isinstance(bag, int) or bag < 1:
      raise ConfigError(f"feature {f.name!r}: bag must be a positive int, got {bag!r}.")
    infos.append(FeatureInfo(f.name, f.table, by_name[f.table].num_rows, bag, f.combiner))
  unread = sorted(set(by_name) - {f.table for f in features})
  if unread:
    raise ConfigError(f"tables {unread} are read by no feature; add a feature or drop them.")
  options = {
    t.name: {
      field.name: getattr(t, field.name)
      for field in dataclasses.fields(TableSpec)
      if field.name not in ("name", "num_rows")
    }
    for t in tables
  }
  return Workload(
    name,
    tuple(infos),
    emb_dim=tables[0].dim,
    examples_per_chip=examples_per_chip,
    num_dense=num_dense,
    hidden=tuple(hidden),
    table_options=options,
    stacking=stacking,
  )


def load(path: str, **defaults) -> Workload:
  """The workload of a JSON configuration file (see the module docstring);
  `defaults` (e.g. examples_per_chip) apply where the file is silent."""
  try:
    with open(path) as f:
      config = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(f"--config {path!r}: cannot read it as JSON: {e}") from e
  return from_dict(config, name=path, **defaults)


def from_dict(config: Mapping, *, name: str = "config", **defaults) -> Workload:
  """The workload of a parsed configuration (see the module docstring)."""
  _check_keys("the configuration", config, TOP_KEYS, required=("tables", "features"))
  tables = [_table(n, t) for n, t in _entries(config, "tables")]
  features, bags = [], {}
  for fname, f in _entries(config, "features"):
    _check_keys(f"feature {fname!r}", f, FEATURE_KEYS, required=("table",))
    features.append(FeatureSpec(fname, f["table"], f.get("combiner", "sum")))
    bags[fname] = f.get("bag", 1)
  kw = defaults | {k: config[k] for k in TOP_KEYS[2:] if k in config}
  return workload_from_specs(tables, features, bags, name=name, **kw)


def _entries(config: Mapping, key: str):
  entries = config[key]
  if not isinstance(entries, Mapping) or not entries:
    raise ConfigError(f"{key!r} must be a non-empty object of name -> settings, got {entries!r}.")
  return entries.items()


def _check_keys(owner: str, entry, allowed: Sequence[str], required: Sequence[str]) -> None:
  if not isinstance(entry, Mapping):
    raise ConfigError(f"{owner} must be an object, got {entry!r}.")
  unknown = sorted(set(entry) - set(allowed) - set(required))
  missing = [k for k in required if k not in entry]
  if unknown or missing:
    raise ConfigError(
      f"{owner}: unknown keys {unknown}, missing keys {missing}; it takes "
      f"{sorted(set(allowed) | set(required))}."
    )


def _table(name: str, entry) -> TableSpec:
  _check_keys(f"table {name!r}", entry, TABLE_KEYS, required=("rows", "dim"))
  kw = {k: v for k, v in entry.items() if k != "rows"}
  if "dtype" in kw:
    if kw["dtype"] not in ("float32", "bfloat16"):
      raise ConfigError(
        f"table {name!r}: dtype must be 'float32' or 'bfloat16', got {kw['dtype']!r}."
      )
    kw["dtype"] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[kw["dtype"]]
  kw["optimizer"] = _optimizer(name, kw.get("optimizer", "sgd"))
  return TableSpec(name, entry["rows"], **kw)


def _optimizer(table: str, entry):
  args = {}
  if isinstance(entry, Mapping):
    args = {k: v for k, v in entry.items() if k != "name"}
    entry = entry.get("name")
  if entry not in OPTIMIZERS:
    raise ConfigError(
      f"table {table!r}: optimizer {entry!r} is not one of {sorted(OPTIMIZERS)} (a name, or "
      '{"name": ..., "learning_rate": ..., ...}).'
    )
  try:
    return OPTIMIZERS[entry](**args)
  except TypeError as e:
    raise ConfigError(f"table {table!r}: optimizer {entry!r}: {e}") from e
