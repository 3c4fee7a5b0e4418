"""Every optimizer's fused update against FBGEMM's nearest, on one workload.

    python -m pallas_emb.bench --json b.json --optimizers=sgd,adagrad,rowwise_adagrad,lazy_adam,ftrl

FBGEMM's CPU table-batched embedding trains with four optimizers only:
EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD and EMAINPLACE_ROWWISE_ADAGRAD
(`SplitTableBatchedEmbeddingBagsCodegen` refuses the others "in CPU mode";
fbgemm_gpu 1.8.0's CPU backward kernels are those and row-wise RMSProp). Its
ADAM, PARTIAL_ROWWISE_ADAM, LAMB and LARS_SGD are GPU-only, and it has no
FTRL: LazyAdam and FTRL are compared with EXACT_ROWWISE_ADAGRAD, the
optimizer FBGEMM users train embeddings with on CPU.

For each optimizer, on V rows x D float32 and the benchmark's N zipf ids, the
fused step (default backend: "native" on CPU) and FBGEMM's backward are
interleaved step by step, then the fused step is profiled stage by stage
(`pallas_emb.bench.stages`). The floor is the memory the update must move at
the run's copy bandwidth: each touched row and its slots read and written
once, each gradient row and id read once.
"""

from __future__ import annotations

import gc
from typing import NamedTuple

import jax
import numpy as np

import pallas_emb as pe
from pallas_emb.bench.methods import EPS, LEARNING_RATE, FbgemmBackward, Fused, SharedTable
from pallas_emb.bench.timing import profile, time_steps
from pallas_emb.bench.workloads import zipf_ids
from pallas_emb.job import host_memory


class Pairing(NamedTuple):
  """One of our optimizers, and the FBGEMM optimizer timed beside it."""

  ours: pe.EmbeddingOptimizer
  fbgemm: str  # an fbgemm_gpu OptimType name its CPU path runs
  note: str  # why that one, when it is not the same optimizer


PAIRINGS = {
  "sgd": Pairing(pe.SGD(LEARNING_RATE), "EXACT_SGD", ""),
  "adagrad": Pairing(
    pe.Adagrad(LEARNING_RATE, initial_accumulator_value=0.0, eps=EPS), "EXACT_ADAGRAD", ""
  ),
  "rowwise_adagrad": Pairing(
    pe.RowWiseAdagrad(LEARNING_RATE, eps=EPS, half_life_steps=None), "EXACT_ROWWISE_ADAGRAD", ""
  ),
  "lazy_adam": Pairing(
    pe.LazyAdam(LEARNING_RATE), "EXACT_ROWWISE_ADAGRAD", "no Adam on FBGEMM's CPU path"
  ),
  "ftrl": Pairing(pe.FTRL(LEARNING_RATE), "EXACT_ROWWISE_ADAGRAD", "no FTRL in FBGEMM"),
}


def floor_bytes(optimizer, unique: int, num_ids: int, dim: int) -> int:
  """Bytes the update must move: each touched row and its slots read and
  written once, each gradient row and id read once."""
  slot_bytes = sum(
    (s.width_for(dim)) * np.dtype(s.dtype).itemsize for s in optimizer.slot_specs().values()
  )
  return unique * (dim * 4 + slot_bytes) * 2 + num_ids * dim * 4 + num_ids * 4


def run_optimizers(
  names,
  vocab: int,
  num_ids: int,
  dim: int,
  bandwidth: float,
  steps: int,
  warmup: int,
  *,
  profile_steps: int,
  huge_pages: bool,
  with_fbgemm: bool,
) -> dict:
  """The comparison of `names` (keys of `PAIRINGS`) on one workload;
  `with_fbgemm`: FBGEMM imports (else only the fused steps are timed)."""
  ids = zipf_ids(num_ids, vocab)
  unique = int(len(np.unique(ids)))
  capacity = 1 << int(np.ceil(np.log2(unique)))
  grads_np = np.random.default_rng(1).normal(size=(num_ids, dim)).astype(np.float32)
  grads = jax.device_put(grads_np)
  rows = []
  for name in names:
    pairing = PAIRINGS[name]
    shared = SharedTable(vocab, dim, capacity, huge_pages=huge_pages, optimizer=pairing.ours)
    fused = Fused(shared, ids, grads)
    runners = [fused]
    if with_fbgemm:
      runners.append(
        FbgemmBackward(vocab, dim, ids, grads_np, huge_pages=huge_pages, optimizer=pairing.fbgemm)
      )
    summary = time_steps(runners, steps, warmup)
    summary["fused"]["backend"] = fused.backend
    floor = floor_bytes(pairing.ours, unique, num_ids, dim)
    row = {
      "optimizer": name,
      "fbgemm_optimizer": pairing.fbgemm if with_fbgemm else None,
      "note": pairing.note,
      "methods": summary,
      "floor_ms": floor / bandwidth * 1e3,
    }
    if profile_steps:
      row["profile"] = profile(fused, profile_steps)
    rows.append(row)
    line = "  ".join(f"{k} {v['median_ms']:.2f} ms" for k, v in summary.items())
    print(f"{name:>16}: {line}  floor {row['floor_ms']:.2f} ms", flush=True)
    del shared, fused, runners
    gc.collect()
    host_memory.release_free_memory()
  return {"vocab": vocab, "ids": num_ids, "dim": dim, "unique": unique, "rows": rows}
