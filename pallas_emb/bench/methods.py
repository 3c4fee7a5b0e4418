"""The updates the benchmark times, one class each, and the table they share.

Every method has a `name` and a `step()` that runs one update and returns
None (the caller times the call) or the seconds of the part it times itself
(FBGEMM's backward, without its forward). The JAX methods pass one table
between them (`SharedTable`): each donates it and hands on the result, so a
10M-row workload holds a single table.

* "fused": this project's sparse update on the default backend of the
  platform (on CPU "native" when its library is built, else "xla");
* "fused_xla": the same on the XLA path (the oracle and fallback);
* "dense": what a JAX user writes without it: `jax.vjp` of the lookup (a
  dense (V, D) gradient) and row-wise Adagrad over the whole table;
* "fbgemm": FBGEMM's CPU table-batched embedding, EXACT_ROWWISE_ADAGRAD
  (or another optimizer its CPU path runs), SUM pooling of bags of one id,
  backward only.

The table's optimizer is row-wise Adagrad unless a method is given another
(`pallas_emb.bench.optimizers` compares every optimizer).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_emb as pe
from pallas_emb.job import host_memory

LEARNING_RATE, EPS = 0.01, 1e-8
METHODS = ("fused", "fused_xla", "dense", "fbgemm")


def rowwise_adagrad() -> pe.RowWiseAdagrad:
  """The benchmark's default optimizer, FBGEMM's EXACT_ROWWISE_ADAGRAD."""
  return pe.RowWiseAdagrad(LEARNING_RATE, eps=EPS, half_life_steps=None)


class SharedTable:
  """One (V, D) table and its optimizer's slots in JAX, and one
  `ShardedEmbedding` per backend over it (they differ only in how the update
  runs)."""

  def __init__(
    self, vocab: int, dim: int, capacity: int, *, huge_pages: bool = True, optimizer=None
  ):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    spec = pe.TableSpec(
      "t",
      vocab,
      dim,
      dtype=jnp.float32,
      optimizer=optimizer or rowwise_adagrad(),
      initializer=jax.nn.initializers.zeros,
      unique_capacity=capacity,
    )
    self._args = ([spec], [pe.FeatureSpec("f", "t", "sum")], mesh, "x")
    self._embs = {}
    self.state = self.emb(None).init(jax.random.key(0))
    # Donated updates keep these buffers, so the advice lasts.
    self.huge_page_bytes = host_memory.use_huge_pages(self.state) if huge_pages else 0

  def emb(self, backend: str | None) -> pe.ShardedEmbedding:
    """The embedding over this table on `backend` (None: the default)."""
    if backend not in self._embs:
      self._embs[backend] = pe.ShardedEmbedding(*self._args, backend=backend)
    return self._embs[backend]


class Fused:
  """`apply_gradients(plan(ids), grads)`, jitted as one step, donated."""

  def __init__(
    self, shared: SharedTable, ids: np.ndarray, grads: jax.Array, backend: str | None = None
  ):
    self.name = "fused" if backend is None else f"fused_{backend}"
    self.shared, self.emb = shared, shared.emb(backend)
    self.backend = self.emb.backend
    emb = self.emb
    self.ids = jax.device_put(ids.reshape(-1, 1))
    self.grads = grads
    self.plan = jax.jit(lambda ids: emb.plan({"f": ids}))
    self._step = jax.jit(
      lambda state, ids, g: emb.apply_gradients(state, emb.plan({"f": ids}), {"f": g})[0],
      donate_argnums=0,
    )

  def step(self):
    self.shared.state = self._step(self.shared.state, self.ids, self.grads)
    jax.block_until_ready(self.shared.state)
    return None


class Dense:
  name = "dense"

  def __init__(self, shared: SharedTable, ids: np.ndarray, grads: jax.Array):
    self.shared = shared
    self.ids, self.grads = jax.device_put(ids), grads

    def step(table, acc, ids, g):
      # The table and accumulator as (rows, D) and (rows, 1), whatever their
      # stored (packed) shapes: float32 packing is the row-major reshape.
      rows = table.reshape(-1, g.shape[-1])
      _, vjp = jax.vjp(lambda t: t[ids], rows)
      (dense_grad,) = vjp(g)
      acc_rows = acc.reshape(-1, 1) + jnp.mean(dense_grad * dense_grad, axis=1, keepdims=True)
      new = rows - LEARNING_RATE * dense_grad / (jnp.sqrt(acc_rows) + EPS)
      return new.reshape(table.shape), acc_rows.reshape(acc.shape)

    self._step = jax.jit(step, donate_argnums=(0, 1))

  def step(self):
    ts = self.shared.state["t"]
    table, acc = self._step(ts.table, ts.slots["acc"], self.ids, self.grads)
    self.shared.state = {"t": pe.TableState(table, {"acc": acc}, ts.step)}
    jax.block_until_ready(table)
    return None


class FbgemmBackward:
  name = "fbgemm"

  def __init__(
    self,
    vocab: int,
    dim: int,
    ids: np.ndarray,
    grads: np.ndarray,
    *,
    huge_pages: bool = True,
    optimizer: str = "EXACT_ROWWISE_ADAGRAD",
  ):
    import torch  # pylint: disable=g-import-not-at-top
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode  # pylint: disable=g-import-not-at-top
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # pylint: disable=g-import-not-at-top
      ComputeDevice,
      OptimType,
      SplitTableBatchedEmbeddingBagsCodegen,
    )

    self.torch = torch
    self.module = SplitTableBatchedEmbeddingBagsCodegen(
      [(vocab, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
      optimizer=OptimType[optimizer],
      learning_rate=LEARNING_RATE,
      eps=EPS,
      pooling_mode=PoolingMode.SUM,
    )
    self.ids = torch.from_numpy(ids.astype(np.int64))
    self.offsets = torch.arange(len(ids) + 1, dtype=torch.int64)
    self.grads = torch.from_numpy(np.asarray(grads))
    # The same treatment as the JAX table: its rows on huge pages too.
    self.huge_page_bytes = (
      sum(
        host_memory.advise_huge_pages(t.data_ptr(), t.numel() * t.element_size())
        for t in (self.module.weights_host, getattr(self.module, "momentum1_host", None))
        if t is not None and t.numel()
      )
      if huge_pages
      else 0
    )

  def step(self) -> float:
    out = self.module(self.ids, self.offsets)  # the forward is not timed
    tic = time.perf_counter()
    out.backward(self.grads)
    return time.perf_counter() - tic


def fbgemm_available() -> str | None:
  """None if FBGEMM imports, else why not."""
  try:
    import fbgemm_gpu  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    import torch  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"
  return None
