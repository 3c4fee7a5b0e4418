"""Benchmark programs and their reports (not library code).

* `python -m pallas_emb.bench` (`__main__`, `run`): the fused sparse update
  against the XLA path, a dense update and FBGEMM (`methods`), per workload
  (`workloads`), with a per-stage profile (`stages`), the machine's state
  (`machine`) and a plot (`plot`); `python -m pallas_emb.bench.report`
  writes the benchmarks page's CPU section from its JSON;
* `python -m pallas_emb.bench.inputs`: what each input form costs;
* `dlrm`: the DLRM-shaped step, stacking off against on.
"""
