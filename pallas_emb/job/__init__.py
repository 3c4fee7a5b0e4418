"""The main job: train and evaluate a ranking model with sharded tables.

`python -m pallas_emb` runs it (`pallas_emb/__main__.py`). Modules, from the
top: `run` (flags -> report), `loop` (steps, evaluation, checkpoints, early
stop), `build` (data, tables, model, trainer), `distributed` (processes and
the mesh), `flags`, `model` (the ranking MLP), `evaluation` and `baselines`,
`run_log` (progress, TensorBoard), `supervisor` (one process of several,
watched for a lost peer), `host_memory` (XLA:CPU allocator settings).
"""
