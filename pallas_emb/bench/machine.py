"""The machine a benchmark runs on: copy bandwidth, peak memory, what it is.

A benchmark's times only mean something beside the machine's state: its
load average at the start, the share of the cores that other processes used
while it ran, and the bandwidth of a 1 GiB copy at the start and end (the
memory floor of a step is bytes / bandwidth).

Why not the load average at the end: it counts the benchmark's own threads
(FBGEMM's backward and XLA:CPU run one per core), so on 2 cores a quiet run
ends near 2. What the other processes took is measured instead: all CPU time
the kernel accounts (`/proc/stat`) less this process's own, over the run.
"""

from __future__ import annotations

import os
import platform
import threading
import time

import jax
import numpy as np

from pallas_emb.bench.methods import fbgemm_available


def copy_bandwidth(size: int = 1 << 30, repeats: int = 5) -> float:
  """Bytes per second moved by a `size`-byte array copy (read + write)."""
  src = np.ones(size // 4, np.float32)
  dst = np.empty_like(src)
  np.copyto(dst, src)
  times = []
  for _ in range(repeats):
    tic = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - tic)
  return 2 * size / float(np.median(times))


class PeakRss:
  """Samples this process's resident set while active; reports the peak."""

  def __init__(self, interval: float = 0.002):
    self.interval, self.peak, self._stop = interval, 0, threading.Event()
    self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

  def _rss(self) -> int:
    try:
      with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * self._page
    except OSError:
      import resource  # pylint: disable=g-import-not-at-top

      return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

  def __enter__(self):
    self.peak = self._rss()
    self._stop.clear()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()
    return self

  def _run(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, self._rss())
      time.sleep(self.interval)

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, self._rss())


class OthersCpu:
  """The share of all cores that other processes used between this object's
  construction and `share()`: (busy CPU seconds of the machine - this process's and its
  children's) / (elapsed seconds x cores), in [0, 1]; None where there is no
  /proc/stat."""

  def __init__(self):
    self._start = self._sample()

  @staticmethod
  def _sample() -> tuple[float, float, float] | None:
    try:
      with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
      return None
    # user nice system idle iowait irq softirq steal ...: idle and iowait are
    # not busy; guest time is already inside user.
    busy = sum(fields[:8]) - fields[3] - fields[4]
    own = sum(os.times()[:4])
    return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), own

  def share(self) -> float | None:
    return self.between(self._start, self._sample(), os.cpu_count() or 1)

  @staticmethod
  def between(start, end, cores: int) -> float | None:
    """Others' share from two (seconds, busy CPU seconds, own CPU seconds)."""
    if start is None or end is None or end[0] <= start[0]:
      return None
    others = (end[1] - start[1]) - (end[2] - start[2])
    return min(max(others / ((end[0] - start[0]) * cores), 0.0), 1.0)


def available_memory() -> int | None:
  """Bytes the kernel could give a new allocation now (MemAvailable), or
  None where /proc/meminfo is not there."""
  try:
    with open("/proc/meminfo") as f:
      lines = f.readlines()
  except OSError:
    return None
  found = [int(l.split()[1]) * 1024 for l in lines if l.startswith("MemAvailable:")]
  return found[0] if found else None


def machine_info(bandwidth: float, malloc_tuned: bool) -> dict:
  info = {
    "platform": platform.platform(),
    "python": platform.python_version(),
    "cpus": os.cpu_count(),
    "jax": jax.__version__,
    "jax_backend": jax.default_backend(),
    "copy_bandwidth_gbps": bandwidth / 1e9,
    "keep_freed_memory": malloc_tuned,
    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    "load_avg": list(os.getloadavg()),
  }
  try:
    with open("/proc/cpuinfo") as f:
      models = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    info["cpu"] = models[0] if models else platform.processor()
    with open("/proc/meminfo") as f:
      info["mem_gb"] = int(f.readline().split()[1]) / 2**20
  except OSError:
    info["cpu"] = platform.processor()
  if fbgemm_available() is None:
    import fbgemm_gpu  # pylint: disable=g-import-not-at-top
    import torch  # pylint: disable=g-import-not-at-top

    info["torch"], info["fbgemm_gpu"] = torch.__version__, fbgemm_gpu.__version__
    info["torch_threads"] = torch.get_num_threads()
  return info
