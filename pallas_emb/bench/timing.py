"""Timing the benchmark's methods: interleaved steps, summaries, profiles."""

from __future__ import annotations

import time

import numpy as np

from pallas_emb.bench import stages as bench_stages
from pallas_emb.bench.machine import PeakRss
from pallas_emb.bench.methods import Fused


def summary(times, peak_rss) -> dict:
  ms = np.asarray(times) * 1e3
  return {
    "median_ms": float(np.median(ms)),
    "min_ms": float(ms.min()),
    "max_ms": float(ms.max()),
    "peak_rss_mb": peak_rss / 2**20,
    "steps": len(ms),
  }


def time_steps(runners, steps: int, warmup: int) -> dict:
  """name -> the summary of `steps` timed steps of each runner, interleaved
  step by step (noise hits every method alike), after `warmup` steps."""
  for r in runners:  # compile, first touch
    for _ in range(warmup):
      r.step()
  times = {r.name: [] for r in runners}
  rss = {r.name: PeakRss() for r in runners}
  for _ in range(steps):
    for r in runners:
      with rss[r.name]:
        tic = time.perf_counter()
        inner = r.step()
        elapsed = time.perf_counter() - tic
      times[r.name].append(inner if isinstance(inner, float) else elapsed)
  return {name: summary(t, rss[name].peak) for name, t in times.items()}


def profile(r: Fused, steps: int) -> dict:
  """The per-stage profile of one fused method; see `stages`."""
  stages = (
    bench_stages.native_stages(r.step, lambda: r.plan(r.ids), steps)
    if r.backend == "native"
    else bench_stages.xla_stages(r.emb, r.shared, r.ids, r.grads, r.step, steps)
  )
  return {"backend": r.backend, "stages_ms": stages}
