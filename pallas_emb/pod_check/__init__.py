"""Check a configuration for a TPU pod before you rent one.

    python -m pallas_emb.pod_check --topology=v5e:4x4 --workload=w_tpu \
        --vocab=4000000 --json=report.json

compiles the main job's training step for every chip of a TPU topology on
this (CPU) machine with libtpu (`pip install "pallas-emb[tpu]"`) and reports
per chip what the step holds (table, slots, temporaries) and moves (XLA's
bytes accessed against the floor, all_to_all bytes), whether a table or slot
is copied per step, and whether the update's collectives overlap the dense
compute. `compile.compile_step` is the API; `hlo` reads the compiled
program; `env` prepares the process.
"""
