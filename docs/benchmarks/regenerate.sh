#!/usr/bin/env bash
# Reruns the benchmark runs whose results docs/benchmarks.md and docs/benchmarks/
# show, then rewrites the page's results section from them. Run it on a quiet
# machine (nothing else running: the methods share the cores and the memory
# bandwidth), from the repository root, with `pip install ".[bench]"` done.
#
#   bash docs/benchmarks/regenerate.sh            # W1/W2, every optimizer, the sweep
#   bash docs/benchmarks/regenerate.sh --no-sweep # W1/W2 and every optimizer only
#
# It stops at once on a busy machine (1-minute load average over 0.5 per
# core) or without a working native library, and `pallas_emb.bench.report`
# refuses to write the page from a run during which other processes took
# more than 10% of the cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=docs/benchmarks

python - <<'EOF'
import os, sys
from pallas_emb.bench.report import MAX_LOAD_PER_CORE
load, cores = os.getloadavg()[0], os.cpu_count()
if load > MAX_LOAD_PER_CORE * cores:
  sys.exit(f"regenerate.sh: the 1-minute load average is {load:.2f}, over {MAX_LOAD_PER_CORE} "
           f"per core ({cores} cores); other processes would share the cores and the memory "
           "bandwidth. Run it on a quiet machine.")
# The figures are the native backend's: a stale or missing library (csrc/
# changed since `pip install`) would time the XLA path instead.
from pallas_emb.kernels import native_lib
status = native_lib.status()
if not status.available:
  sys.exit(f"regenerate.sh: the native library is unavailable ({status.reason}); "
           "reinstall (pip install '.[bench]') first.")
print(f"native library: {status.path}")
EOF

echo "+ W1/W2 (the issue's command), $(date -u +%FT%TZ), load: $(cut -d' ' -f1-3 /proc/loadavg)"
# --optimizers: each optimizer on W1 against FBGEMM's nearest.
python -m pallas_emb.bench --vocab 1000000,10000000 --steps 20 \
  --optimizers sgd,adagrad,rowwise_adagrad,lazy_adam,ftrl \
  --json "$out/w1w2.json" --plot "$out/w1w2.png"
python -m pallas_emb.bench.report "$out/w1w2.json" --page docs/benchmarks.md

if [[ "${1:-}" != "--no-sweep" ]]; then
  echo "+ sweep over V and N, $(date -u +%FT%TZ), load: $(cut -d' ' -f1-3 /proc/loadavg)"
  # Without dense (8 s a step at V = 10M; W1/W2 has it) and without V = 10M,
  # which W1/W2 covers at N = 65,536: the sweep is about N.
  python -m pallas_emb.bench --vocab 100000,1000000 --ids 16384,65536,262144 \
    --methods fused,fused_xla,fbgemm --steps 20 --pipeline_steps 0 --profile_steps 0 \
    --json "$out/sweep.json" --plot "$out/sweep.png"
fi
python -m pallas_emb.bench.report "$out/w1w2.json"
