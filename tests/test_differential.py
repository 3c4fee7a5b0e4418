"""Every backend on this machine against a float64 NumPy oracle.

One step (lookup, a random upstream gradient, apply_gradients) of an
embedding drawn by Hypothesis from the grid: D in 1-8, 12, 16, 24, 48, 64,
96, 128, 192, 256 (packed, padded and plain storage) x float32 / bfloat16 x
SGD, Adagrad, row-wise Adagrad, LazyAdam, FTRL x layout "mod" / "range" x
stacked or alone x a replicated table beside it x a dynamic vocabulary, on
1, 3 or 4 devices, with random ids: padding, duplicates and invalid ids.
Each backend's activations, tables and slots are compared with the float64
reference of the same step (`optimizer_reference`): exactly where every sum
is exact (SGD on dyadic values with sum pooling), else within float32 (or
one bfloat16 ulp) of it. The explicit examples are the reliability faults
this test was written for: padded float32 widths on several devices, which
the native backend once updated at the gradients' stride, and a dynamic
table on uneven shards, whose map once refused ids in an empty table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import make_mesh
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from optimizer_reference import OPTIMIZERS, apply

import pallas_emb as pe
from pallas_emb.kernels import native_lib
from pallas_emb.vocabulary import DynamicVocabulary

BACKENDS = ["xla", "interpret"] + (["native"] if native_lib.available() else [])
DIMS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 48, 64, 96, 128, 192, 256]
# 512 rows over 3 or 4 devices are uneven shards: a dynamic table's map
# slots without a row must not swallow an id's whole probe window.
ROWS = {"t": 512, "u": 150, "r": 40}
L = 3


@dataclasses.dataclass(frozen=True)
class Config:
  dim: int
  dtype: str
  optimizer: str
  layout: str
  stacked: bool
  replicated: bool
  dynamic: bool
  devices: int
  combiner: str | None
  seed: int

  @property
  def names(self) -> tuple[str, ...]:
    return ("t",) + ("u",) * (self.stacked and not self.dynamic) + ("r",) * self.replicated

  @property
  def exact(self) -> bool:
    return self.optimizer == "sgd" and self.combiner in ("sum", None)


configs = st.builds(
  Config,
  dim=st.sampled_from(DIMS),
  dtype=st.sampled_from(["float32", "bfloat16"]),
  optimizer=st.sampled_from(sorted(OPTIMIZERS)),
  layout=st.sampled_from(["mod", "range"]),
  stacked=st.booleans(),
  replicated=st.booleans(),
  dynamic=st.booleans(),
  devices=st.sampled_from([1, 3, 4]),
  combiner=st.sampled_from(["sum", "mean", None]),
  seed=st.integers(0, 2**16),
)


def _dyadic(key, shape, dtype):
  """Multiples of 1/64 in [-1, 1]: sums of a few are exact in float32 and
  round to bfloat16 alike from float32 and float64."""
  return (jnp.round(jax.random.uniform(key, shape, minval=-64, maxval=64)) / 64).astype(dtype)


def _embedding(cfg: Config, backend: str):
  opt, _ = OPTIMIZERS[cfg.optimizer]
  dtype = jnp.dtype(cfg.dtype if cfg.dim % 2 == 0 else "float32")
  common = dict(dim=cfg.dim, dtype=dtype, optimizer=opt, initializer=_dyadic)
  tables = [
    pe.TableSpec(
      "t",
      ROWS["t"],
      layout="mod" if cfg.dynamic else cfg.layout,
      vocabulary=DynamicVocabulary() if cfg.dynamic else None,
      **common,
    )
  ]
  if "u" in cfg.names:
    tables.append(pe.TableSpec("u", ROWS["u"], layout=cfg.layout, **common))
  if cfg.replicated:
    tables.append(pe.TableSpec("r", ROWS["r"], placement="replicated", **common))
  features = [pe.FeatureSpec(f"f_{n}", n, cfg.combiner) for n in cfg.names]
  mesh = make_mesh(cfg.devices)
  return pe.ShardedEmbedding(tables, features, mesh, "x", backend, stacking="auto")


def _inputs(cfg: Config):
  """Ids per feature (padding, duplicates, invalid ids) and the upstream
  gradient per activation, dyadic."""
  rng = np.random.default_rng(cfg.seed)
  b = 4 * cfg.devices
  ids = {}
  for n in cfg.names:
    v = ROWS[n]
    x = rng.integers(0, v // 4 if rng.random() < 0.5 else v, (b, L))  # duplicates, often
    x = np.where(rng.random((b, L)) < 0.15, -1, x)  # padding
    if not (cfg.dynamic and n == "t"):
      x = np.where(rng.random((b, L)) < 0.1, rng.choice([v, v + 7, -3]), x)  # invalid
    ids[f"f_{n}"] = x.astype(np.int64 if cfg.dynamic and n == "t" else np.int32)
  shape = (b, L, cfg.dim) if cfg.combiner is None else (b, cfg.dim)
  grads = {f: np.round(rng.uniform(-128, 128, shape)) / 64 for f in ids}
  return ids, {f: g.astype(np.float32) for f, g in grads.items()}


def run(cfg: Config, backend: str):
  """One step on `backend`: (rows looked up per feature, logical tables and
  slots before, activations, logical tables and slots after), float64."""
  emb = _embedding(cfg, backend)
  tables = emb.init(jax.random.key(0))
  ids, grads = _inputs(cfg)
  if cfg.dynamic:
    vocabs = emb.init_vocabularies(jax.random.key(1))
    rows, tables, vocabs, metrics = emb.admit(tables, vocabs, {"f_t": ids["f_t"]})
    assert int(metrics["t"].failed) == 0 and int(metrics["t"].misses) == 0
    ids = {**ids, "f_t": np.asarray(rows["f_t"])}
  state = lambda tabs: {
    n: (
      np.asarray(emb.logical_table(tabs, n), np.float64),
      {k: np.asarray(v, np.float64) for k, v in emb.logical_slots(tabs, n).items()},
    )
    for n in cfg.names
  }
  before = state(tables)
  acts, res = emb.lookup(tables, ids)
  tables, _ = emb.apply_gradients(tables, res, grads)
  return ids, before, {k: np.asarray(v, np.float64) for k, v in acts.items()}, state(tables)


def reference(cfg: Config, ids, before, grads):
  """The float64 step: activations, and each table's rows and slots after."""
  acts, after = {}, {}
  for n in cfg.names:
    table, slots = before[n]
    x = np.asarray(ids[f"f_{n}"])
    valid = (x >= 0) & (x < ROWS[n])
    rows = table[np.where(valid, x, 0)] * valid[..., None]
    upstream = np.asarray(grads[f"f_{n}"], np.float64)
    if cfg.combiner is None:
      acts[f"f_{n}"], token_grads = rows, upstream
    else:
      count = valid.sum(1, keepdims=True)
      scale = 1.0 if cfg.combiner == "sum" else 1.0 / np.maximum(count, 1)
      acts[f"f_{n}"] = rows.sum(1) * scale
      token_grads = np.broadcast_to((upstream * scale)[:, None, :], rows.shape)
    g = np.zeros_like(table)
    np.add.at(g, x[valid], token_grads[valid])
    touched = np.zeros(ROWS[n], bool)
    touched[x[valid]] = True
    rows, new_slots = apply(cfg.optimizer, table, slots, g, touched)
    if cfg.dtype == "bfloat16" and cfg.dim % 2 == 0:
      # A bfloat16 table stores its rows rounded to nearest even.
      rows = rows.astype(ml_dtypes.bfloat16).astype(np.float64)
    after[n] = (rows, new_slots)
  return acts, after


def _close(got, want, cfg: Config, what: str):
  if cfg.exact:
    np.testing.assert_array_equal(got, want, err_msg=what)
    return
  if cfg.dtype == "bfloat16" and cfg.dim % 2 == 0 and what.startswith("table"):
    # One bfloat16 ulp: float32 and float64 may round to either neighbour.
    ulp = np.abs(want).astype(ml_dtypes.bfloat16).astype(np.float64) * 2.0**-7
    assert (np.abs(got - want) <= ulp + 1e-30).all(), what
    return
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=what)


def check(cfg: Config):
  ids, grads = _inputs(cfg)
  seen = {}
  for backend in BACKENDS:
    got_ids, before, acts, after = run(cfg, backend)
    # Every backend starts from the same state (and admits the same rows).
    for n in cfg.names:
      if n in seen:
        np.testing.assert_array_equal(before[n][0], seen[n], f"{backend}: initial {n}")
      seen[n] = before[n][0]
    want_acts, want = reference(cfg, got_ids, before, grads)
    for f in want_acts:
      _close(acts[f], want_acts[f], cfg, f"{backend} activations {f}")
    for n in cfg.names:
      _close(after[n][0], want[n][0], cfg, f"table {n} on {backend}")
      for k in want[n][1]:
        np.testing.assert_allclose(
          after[n][1][k], want[n][1][k], rtol=2e-5, atol=2e-6, err_msg=f"{backend} slot {n}/{k}"
        )


# The faults this test was written for, always run: padded float32 widths
# (96, 48, 6) on several devices, stacked and alone, and a dynamic table.
EXAMPLES = [
  Config(96, "float32", "sgd", "mod", False, False, False, 4, "sum", 1),
  Config(48, "float32", "rowwise_adagrad", "range", True, True, False, 3, "mean", 2),
  Config(6, "float32", "lazy_adam", "mod", False, False, True, 3, None, 3),
]


@pytest.mark.parametrize("cfg", EXAMPLES, ids=["d96-sgd", "d48-rowwise-stacked", "d6-dynamic"])
def test_the_faults_match_the_float64_reference(cfg):
  check(cfg)


@pytest.mark.grid
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cfg=configs)
@example(cfg=Config(192, "bfloat16", "ftrl", "range", True, True, False, 4, "sum", 4))
@example(cfg=Config(4, "bfloat16", "sgd", "mod", False, True, False, 1, "sum", 0))
def test_every_backend_matches_the_float64_reference(cfg):
  check(cfg)


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cfg=configs)
def test_a_few_drawn_embeddings_match_the_float64_reference(cfg):
  check(cfg)
