#!/usr/bin/env bash
# Reruns the benchmark runs whose results the README and docs/benchmarks/
# show, then rewrites README's results section from them. Run it on a quiet
# machine (nothing else running: the methods share the cores and the memory
# bandwidth), from the repository root, with `pip install ".[bench]"` done.
#
#   bash docs/benchmarks/regenerate.sh            # W1/W2 and the sweep
#   bash docs/benchmarks/regenerate.sh --no-sweep # W1/W2 only (a few minutes)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=docs/benchmarks

echo "+ W1/W2 (the issue's command), $(date -u +%FT%TZ), load: $(cut -d' ' -f1-3 /proc/loadavg)"
python -m pallas_emb.bench --vocab 1000000,10000000 --steps 20 \
  --json "$out/w1w2.json" --plot "$out/w1w2.png"
python -m pallas_emb.bench.report "$out/w1w2.json" --readme README.md

if [[ "${1:-}" != "--no-sweep" ]]; then
  echo "+ sweep over V and N, $(date -u +%FT%TZ), load: $(cut -d' ' -f1-3 /proc/loadavg)"
  # Without dense (8 s a step at V = 10M; W1/W2 has it) and without V = 10M,
  # which W1/W2 covers at N = 65,536: the sweep is about N.
  python -m pallas_emb.bench --vocab 100000,1000000 --ids 16384,65536,262144 \
    --methods fused,fused_xla,fbgemm --steps 20 --pipeline_steps 0 --profile_steps 0 \
    --json "$out/sweep.json" --plot "$out/sweep.png"
fi
python -m pallas_emb.bench.report "$out/w1w2.json"
