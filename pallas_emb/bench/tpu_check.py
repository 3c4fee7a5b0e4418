"""On a TPU: every table shape through the Pallas kernels against the XLA
path, and the step times of both.

    python -m pallas_emb.bench.tpu_check [--json tpu_check.json] [--quick]

The test suite runs the kernels in Pallas' TPU interpret mode and compiles
them for TPU topologies on CPU; Mosaic's own passes and the chip's DMA
engines run only here. For each case (dtype, dim, optimizer, stochastic
rounding) one table on one chip trains three steps twice, from the same
state on the same Zipf-drawn ids (duplicates within a step, ids past the
table invalid): once with `backend="pallas"` and once with `backend="xla"`
(the oracle). The report gives, per case, for the activations, the table and
each slot (logical rows): whether they are bit-identical, how many entries
differ, and the largest difference (absolute, and over the largest value).

Timing (`--time`): the grid of `tpu_grid` (21 table shapes at W-TPU's batch
on one chip), each step in its forms side by side: the default path, the
XLA path, a plain-JAX step, and the HBM floor of its unique rows
(`--grid_only` times the cases whose names contain one of its words).

Runs on CPU too (backend "interpret" for "pallas", tiny sizes with
--quick), which is how the test suite checks the program itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb.bench import tpu_grid
from pallas_emb.job.model import item_history_loss

OPTIMIZERS = {
  "sgd": lambda: pe.SGD(0.05),
  "adagrad": lambda: pe.Adagrad(0.05),
  "rowwise_adagrad": lambda: pe.RowWiseAdagrad(0.05, half_life_steps=None),
  "lazy_adam": lambda: pe.LazyAdam(0.005),
  "ftrl": lambda: pe.FTRL(0.5),
  # Its math in XLA, its rows through the kernels (`kernels.staged_update`).
  "optax_adam": lambda: pe.OptaxRows(optax.adam(0.005)),
}


@dataclasses.dataclass(frozen=True)
class Case:
  dtype: str
  dim: int
  optimizer: str
  stochastic_rounding: bool = False

  @property
  def name(self) -> str:
    sr = "+sr" if self.stochastic_rounding else ""
    return f"{self.dtype}-D{self.dim}-{self.optimizer}{sr}"


def cases(quick: bool) -> list[Case]:
  """Every optimizer at f32 D=128 and bf16 D=64; every packed width with
  row-wise Adagrad; bf16 with stochastic rounding; OptaxRows(adam) packed."""
  if quick:  # a packed bf16 table rounded stochastically, with a scalar slot
    return [Case("bfloat16", 64, "rowwise_adagrad", True)]
  out = [Case("float32", 128, o) for o in OPTIMIZERS] + [
    Case("bfloat16", 64, o) for o in OPTIMIZERS if o != "optax_adam"
  ]
  out += [Case("float32", d, "rowwise_adagrad") for d in (16, 32, 64, 256)]
  out += [Case("bfloat16", d, "rowwise_adagrad") for d in (16, 32, 128)]
  out += [Case("bfloat16", 64, "rowwise_adagrad", True), Case("bfloat16", 128, "lazy_adam", True)]
  out += [Case("float32", 16, "optax_adam"), Case("bfloat16", 64, "optax_adam", True)]
  # Widths stored padded (`pallas_emb.packing.padded_width`).
  out += [Case("float32", 96, "rowwise_adagrad"), Case("bfloat16", 96, "lazy_adam")]
  out += [Case("float32", 192, "lazy_adam"), Case("bfloat16", 192, "rowwise_adagrad")]
  return out


def _embedding(case: Case, rows: int, backend: str, mesh):
  spec = pe.TableSpec(
    "t",
    rows,
    case.dim,
    optimizer=OPTIMIZERS[case.optimizer](),
    dtype=jnp.dtype(case.dtype),
    stochastic_rounding=case.stochastic_rounding,
  )
  feats = [pe.FeatureSpec("item", "t", "sum"), pe.FeatureSpec("history", "t", "mean")]
  return pe.ShardedEmbedding([spec], feats, mesh, "x", backend)


def _ids(rng, rows: int, batch: int, bag: int) -> dict[str, np.ndarray]:
  """Zipf(1.1) ids (many duplicates), a few padding (-1) and invalid (>= rows)."""

  def draw(shape):
    ids = ((rng.zipf(1.1, shape) - 1) % (rows + rows // 50)).astype(np.int32)
    return np.where(rng.random(shape) < 0.02, -1, ids)

  return {"item": draw((batch, 1)), "history": draw((batch, bag))}


def _one_chip():
  """A mesh of this process's first device (one chip, axis "x")."""
  return jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])


def step_fn(emb):
  """(tables, ids, label) -> (tables, acts): one jitted training step."""

  def step(tables, ids, label):
    acts, res = emb.lookup(tables, ids)
    grads = jax.grad(item_history_loss)(acts, label)
    return emb.apply_gradients(tables, res, grads)[0], acts

  return jax.jit(step, donate_argnums=0)


def _diff(a: np.ndarray, b: np.ndarray) -> dict:
  """How far `a` is from `b`: identical?, entries differing, the largest
  absolute difference and that over b's largest magnitude."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  err = float(np.max(np.abs(a - b), initial=0))
  return {
    "identical": bool(np.array_equal(a, b)),
    "differing": int(np.sum(a != b)),
    "max_abs": err,
    "max_rel": err / max(float(np.max(np.abs(b), initial=0)), 1e-30),
  }


def compare(case: Case, *, rows: int, batch: int, bag: int, steps: int, pallas: str) -> dict:
  """Trains `case` `steps` steps on `pallas` and on "xla" from one state;
  returns the differences (see the module docstring)."""
  mesh = _one_chip()
  runs = {}
  for backend in (pallas, "xla"):
    emb = _embedding(case, rows, backend, mesh)
    tables = emb.init(jax.random.key(0))
    step, rng = step_fn(emb), np.random.default_rng(0)
    acts = []
    for _ in range(steps):
      ids = _ids(rng, rows, batch, bag)
      label = (rng.random(batch) < 0.3).astype(np.float32)
      tables, a = step(tables, ids, label)
      acts.append({k: np.asarray(v) for k, v in a.items()})
    # Logical rows only (as float32): the padding rows of a shard and the
    # row that absorbs invalid ids hold no table row.
    runs[backend] = (
      np.asarray(emb.logical_table(tables, "t"), np.float32),
      emb.logical_slots(tables, "t"),
      acts,
    )
  (t_p, s_p, a_p), (t_x, s_x, a_x) = runs[pallas], runs["xla"]
  return {
    "case": case.name,
    "table": _diff(t_p, t_x),
    "rows_differing": int(np.sum(np.any(t_p != t_x, axis=1))),
    "acts": _diff(
      np.concatenate([p[k].ravel() for p in a_p for k in sorted(p)]),
      np.concatenate([x[k].ravel() for x in a_x for k in sorted(x)]),
    ),
    "slots": {k: _diff(s_p[k], s_x[k]) for k in s_p},
  }


def time_parts(case: Case, *, rows: int, batch: int, bag: int, steps: int, pallas: str) -> dict:
  """Median times of the lookup alone and of apply_gradients alone (from
  one lookup's residuals and a fixed gradient), per backend, interleaved."""
  mesh = _one_chip()
  ids = jax.device_put(_ids(np.random.default_rng(2), rows, batch, bag))
  runs = {}
  for backend in (pallas, "xla"):
    emb = _embedding(case, rows, backend, mesh)
    tables = emb.init(jax.random.key(0))
    lookup = jax.jit(emb.lookup)
    acts, res = lookup(tables, ids)
    grads = jax.tree.map(lambda a: 1e-3 * jnp.ones_like(a), acts)
    apply = jax.jit(lambda t, r, g, emb=emb: emb.apply_gradients(t, r, g)[0], donate_argnums=0)
    runs[backend] = dict(
      lookup=lookup, apply=apply, tables=tables, res=res, grads=grads, t_lookup=[], t_apply=[]
    )
  for i in range(steps + 2):
    for r in runs.values():
      tic = time.perf_counter()
      jax.block_until_ready(r["lookup"](r["tables"], ids))
      mid = time.perf_counter()
      r["tables"] = r["apply"](r["tables"], r["res"], r["grads"])
      jax.block_until_ready(r["tables"])
      if i >= 2:
        r["t_lookup"].append(mid - tic)
        r["t_apply"].append(time.perf_counter() - mid)
  med = lambda x: 1e3 * float(np.median(x))
  return {
    "case": case.name,
    "ids": batch * (bag + 1),
    "lookup_ms": {b: med(r["t_lookup"]) for b, r in runs.items()},
    "apply_ms": {b: med(r["t_apply"]) for b, r in runs.items()},
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--json", default=None)
  ap.add_argument("--quick", action="store_true", help="one case, tiny sizes (a smoke test)")
  ap.add_argument("--time", action="store_true", help="also time the grid of steps on one chip")
  ap.add_argument(
    "--grid_only", default="", help="comma-separated words: time the grid cases naming one"
  )
  ap.add_argument("--steps", type=int, default=20, help="timed steps per form")
  ap.add_argument(
    "--parts", action="store_true", help="also time the lookup and the update apart, two batches"
  )
  ap.add_argument("--no_cases", action="store_true", help="skip the comparisons")
  ap.add_argument("--only", default="", help="compare only the cases whose name contains this")
  a = ap.parse_args(argv)
  on_tpu = jax.devices()[0].platform == "tpu"
  pallas = "pallas" if on_tpu else "interpret"
  size = (
    dict(rows=512, batch=32, bag=4, steps=2)
    if a.quick
    else dict(rows=20_000, batch=1024, bag=8, steps=3)
  )
  report = {"device": jax.devices()[0].device_kind, "pallas_backend": pallas, "cases": []}
  for case in [] if a.no_cases else [c for c in cases(a.quick) if a.only in c.name]:
    try:
      r = compare(case, pallas=pallas, **size)
    except Exception as e:  # a case that fails to compile or run is reported, not hidden
      r = {"case": case.name, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    report["cases"].append(r)
    print(json.dumps(r), flush=True)
  if a.time:
    report["grid"] = []
    words = [w for w in a.grid_only.split(",") if w]
    for case in tpu_grid.grid():
      if words and not any(w in case.name for w in words):
        continue
      if a.quick:  # the program on CPU: a small table, a small batch
        case = dataclasses.replace(case, rows=4096, batch=64)
      try:
        t = tpu_grid.time_case(case, steps=a.steps, mesh=_one_chip())
      except Exception as e:  # reported, not hidden
        t = {"case": case.name, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
      report["grid"].append(t)
      print(json.dumps(t), flush=True)
  if a.parts:
    report["parts"] = []
    for batch in (512, 4096):
      for case in (Case("float32", 128, "rowwise_adagrad"), Case("float32", 32, "sgd")):
        t = time_parts(case, rows=1_000_000, batch=batch, bag=20, steps=20, pallas=pallas)
        report["parts"].append(t)
        print(json.dumps(t), flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(report, f, indent=1)
  return report


if __name__ == "__main__":
  main()
