"""On a TPU: one table's training step over a grid of table shapes, in three
forms side by side, beside the HBM floor of its unique rows.

    python -m pallas_emb.bench.tpu_check --time [--grid_only W-TPU,...]

Per case (one table on one chip; W-TPU's batch: 4,096 examples of one item
and 20 history ids, Zipf(1.1), about 36,000 unique at 1M rows):

* "default": `ShardedEmbedding(backend=None)`, which on a TPU runs the
  kernels' forms that the cost model picks (`kernels.forms`);
* "xla": `backend="xla"`, XLA's own gather and scatter;
* "plain": the step a user writes in 20 lines of plain JAX: `jnp.unique`
  with a static size, the rows gathered, the pooled loss differentiated
  (XLA sums the token gradients per unique row), the optimizer's own
  `update_rows`, and `.at[].set(unique_indices=True)` into the donated
  table and slots;
* where the default picked one form, the other ("block" or "xla") is the
  forced alternative, so both forms are measured (`forms.forcing`).

Every form is jitted with the table donated and timed interleaved, step by
step, in one process: the median of `steps` steps after two that compile.
The floor is the unique rows' bytes (row and slots, read and written) over
the chip's peak HBM bandwidth.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_emb as pe
from pallas_emb.job.model import item_history_loss
from pallas_emb.kernels import forms

# Peak HBM bandwidth per chip, bytes/s (public specifications).
HBM_BYTES_PER_S = {"v5 lite": 819e9, "v5e": 819e9, "v6 lite": 1640e9, "v5p": 2765e9, "v4": 1228e9}


@dataclasses.dataclass(frozen=True)
class GridCase:
  dtype: str
  dim: int
  optimizer: str
  rows: int = 1_000_000
  batch: int = 4096

  @property
  def name(self) -> str:
    size = f"{self.rows // 1000}k" if self.rows < 1_000_000 else f"{self.rows // 1_000_000}M"
    return f"{self.dtype}-D{self.dim}-{self.optimizer}-{size}-b{self.batch}"


OPTIMIZERS = {
  "rowwise_adagrad": lambda: pe.RowWiseAdagrad(0.05, half_life_steps=None),
  "lazy_adam": lambda: pe.LazyAdam(0.005),
  "sgd": lambda: pe.SGD(0.05),
  "ftrl": lambda: pe.FTRL(0.5),
}

BAG = 20


def grid() -> list[GridCase]:
  """The 21 cases: D in {16, 64, 128, 256} x {float32, bfloat16} x {row-wise
  Adagrad, LazyAdam} at 1M rows; float32 D=128 row-wise Adagrad at 100k and
  4M rows and at 512 examples; SGD and FTRL at float32 D=128."""
  out = [
    GridCase(dt, d, o)
    for o in ("rowwise_adagrad", "lazy_adam")
    for dt in ("float32", "bfloat16")
    for d in (16, 64, 128, 256)
  ]
  out += [GridCase("float32", 128, "rowwise_adagrad", rows=r) for r in (100_000, 4_000_000)]
  out += [GridCase("float32", 128, "rowwise_adagrad", batch=512)]
  out += [GridCase("float32", 128, o) for o in ("sgd", "ftrl")]
  return out


def draw_ids(rng, rows: int, batch: int) -> dict[str, np.ndarray]:
  """W-TPU's ids: Zipf(1.1) over the rows, one item and `BAG` history ids."""
  draw = lambda shape: ((rng.zipf(1.1, shape) - 1) % rows).astype(np.int32)
  return {"item": draw((batch, 1)), "history": draw((batch, BAG))}


def plain_step(optimizer, rows: int, dim: int, dtype):
  """The plain-JAX step (see the module docstring): (table (rows, dim) of
  `dtype`, slots {name: (rows, width)}, ids, label) -> (table, slots)."""
  specs = optimizer.slot_specs()

  def step(table, slots, ids, label):
    flat = jnp.concatenate([ids["item"].reshape(-1), ids["history"].reshape(-1)])
    n = flat.shape[0]
    uniq, inv = jnp.unique(flat, size=n, fill_value=rows, return_inverse=True)
    got = jnp.take(table, uniq, axis=0, mode="fill", fill_value=0).astype(jnp.float32)

    def loss(got):
      tokens = got[inv.reshape(-1)]
      item = tokens[: ids["item"].size]
      history = tokens[ids["item"].size :].reshape(ids["history"].shape + (dim,)).mean(1)
      return item_history_loss({"item": item, "history": history}, label)

    grads = jax.grad(loss)(got)
    old = {k: jnp.take(v, uniq, axis=0, mode="fill", fill_value=0) for k, v in slots.items()}
    new_rows, new_slots = optimizer.update_rows(got, old, grads, optimizer.scalars(jnp.int32(1)))
    put = lambda x, v: x.at[uniq].set(v.astype(x.dtype), mode="drop", unique_indices=True)
    return put(table, new_rows), {k: put(v, new_slots[k]) for k, v in slots.items()}

  def init():
    table = jax.random.normal(jax.random.key(0), (rows, dim), jnp.float32).astype(dtype) * 0.01
    return table, {k: jnp.full((rows, s.width_for(dim)), s.init, s.dtype) for k, s in specs.items()}

  return jax.jit(step, donate_argnums=(0, 1)), init


def library_step(case: GridCase, backend, mesh):
  """(jitted step (tables, ids, label) -> tables, initial tables)."""
  spec = pe.TableSpec(
    "t", case.rows, case.dim, optimizer=OPTIMIZERS[case.optimizer](), dtype=jnp.dtype(case.dtype)
  )
  feats = [pe.FeatureSpec("item", "t", "sum"), pe.FeatureSpec("history", "t", "mean")]
  emb = pe.ShardedEmbedding([spec], feats, mesh, "x", backend)

  def step(tables, ids, label):
    acts, res = emb.lookup(tables, ids)
    return emb.apply_gradients(tables, res, jax.grad(item_history_loss)(acts, label))[0]

  return jax.jit(step, donate_argnums=0), emb.init(jax.random.key(0)), emb


def floor_ms(case: GridCase, unique: int, device_kind: str) -> float | None:
  """The unique rows' bytes, read and written, at peak HBM bandwidth."""
  bw = next((v for k, v in HBM_BYTES_PER_S.items() if k in device_kind.lower()), None)
  if bw is None:
    return None
  opt = OPTIMIZERS[case.optimizer]()
  row = case.dim * jnp.dtype(case.dtype).itemsize
  slots = sum(s.width_for(case.dim) * 4 for s in opt.slot_specs().values())
  return 1e3 * 2 * unique * (row + slots) / bw


def time_case(case: GridCase, *, steps: int, mesh) -> dict:
  """Every form of `case`, interleaved; see the module docstring."""
  rng = np.random.default_rng(1)
  batches = [
    (
      jax.device_put(draw_ids(rng, case.rows, case.batch)),
      jax.device_put(np.zeros(case.batch, np.float32)),
    )
    for _ in range(4)
  ]
  unique = int(
    np.mean([np.unique(np.concatenate([v.ravel() for v in b[0].values()])).size for b in batches])
  )
  runs, chosen = {}, {}
  for name, backend, form in (("default", None, "auto"), ("xla", "xla", "auto")):
    with forms.forcing(form):
      step, tables, emb = library_step(case, backend, mesh)
      jax.block_until_ready(step(tables, *batches[0]))  # traced (and its forms chosen) here
      tables = emb.init(jax.random.key(0))
    runs[name] = dict(call=lambda s, b, step=step: step(s, *b), state=tables)
    if name == "default":
      chosen = _chosen_forms(emb, case)
  alt = "xla" if chosen.get("update") == "block" else "block"
  if alt == "block":
    with forms.forcing("block"):
      step, tables, emb = library_step(case, None, mesh)
      jax.block_until_ready(step(tables, *batches[0]))
      runs["block"] = dict(
        call=lambda s, b, step=step: step(s, *b), state=emb.init(jax.random.key(0))
      )
  plain, init = plain_step(OPTIMIZERS[case.optimizer](), case.rows, case.dim, jnp.dtype(case.dtype))
  runs["plain"] = dict(call=lambda s, b: plain(*s, *b), state=init())
  times = {k: [] for k in runs}
  for i in range(steps + 2):
    for name, run in runs.items():
      tic = time.perf_counter()
      run["state"] = run["call"](run["state"], batches[i % len(batches)])
      jax.block_until_ready(run["state"])
      if i >= 2:
        times[name].append(time.perf_counter() - tic)
  ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
  return {
    "case": case.name,
    "rows": case.rows,
    "ids": case.batch * (BAG + 1),
    "unique": unique,
    "forms": chosen,
    "median_ms": ms,
    "default_over_xla": ms["default"] / ms["xla"],
    "default_over_plain": ms["default"] / ms["plain"],
    "floor_ms": floor_ms(case, unique, jax.devices()[0].device_kind),
  }


def _chosen_forms(emb, case: GridCase) -> dict[str, str]:
  """What the cost model picks for the case's table (one shard)."""
  from pallas_emb import kernels

  state = jax.eval_shape(emb.init, jax.random.key(0))["t"]
  spec = emb.table_spec("t")
  caps = emb.sharded_table("t", case.batch * (BAG + 1)).capacities
  return {
    "update": kernels.update_form(
      emb.backend, state.table, state.slots, caps.owner, dim=spec.dim, dtype=spec.dtype
    ),
    "gather": kernels.gather_form(
      emb.backend, state.table, caps.route, dim=spec.dim, dtype=spec.dtype, ascending=True
    ),
  }


def table(grid: list[dict]) -> str:
  """The grid's results as a Markdown table: each form's median step, the
  default over XLA and over plain JAX, and the floor."""
  rows = [
    "| case | unique ids | forms (update, gather) | default | XLA path | plain JAX | default / XLA "
    "| default / plain | HBM floor |",
    "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r in grid:
    if "error" in r:
      rows.append(f"| {r['case']} | | error: {r['error'][:80]} | | | | | | |")
      continue
    ms = r["median_ms"]
    forms_ = f"{r['forms']['update']}, {r['forms']['gather']}"
    floor = f"{r['floor_ms']:.3f} ms" if r.get("floor_ms") is not None else ""
    rows.append(
      f"| {r['case']} | {r['unique']:,} | {forms_} | {ms['default']:.2f} ms | {ms['xla']:.2f} ms "
      f"| {ms['plain']:.2f} ms | {r['default_over_xla']:.2f} | {r['default_over_plain']:.2f} "
      f"| {floor} |"
    )
  return "\n".join(rows)


def plot(grid: list[dict], path: str) -> None:
  """Each case's step in every form measured, beside its HBM floor (log
  scale), as a bar chart."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  grid = [r for r in grid if "error" not in r]
  forms_ = ["default", "xla", "block", "plain"]
  fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(grid)), 4.5))
  width = 0.8 / (len(forms_) + 1)
  for i, form in enumerate(forms_ + ["floor"]):
    xs = [k + (i - len(forms_) / 2) * width for k in range(len(grid))]
    ys = [r["floor_ms"] if form == "floor" else r["median_ms"].get(form) for r in grid]
    pts = [(x, y) for x, y in zip(xs, ys) if y]
    if pts:
      ax.bar(*zip(*pts), width=width, label=form if form != "floor" else "HBM floor")
  ax.set_yscale("log")
  ax.set_ylabel("step (ms, median)")
  ax.set_xticks(range(len(grid)))
  ax.set_xticklabels([r["case"] for r in grid], rotation=20, ha="right", fontsize=8)
  ax.legend(fontsize=8)
  ax.set_title("One table's step on one TPU v5e chip, forms side by side")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
