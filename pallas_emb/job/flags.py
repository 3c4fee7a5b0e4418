"""The main job's command-line flags, checked when they are parsed.

Every range is refused by absl at parse time (before JAX starts), with the
flag's name, its limit and the fix; `embedding_optimizer` turns --optimizer
and --emb_learning_rate into an optimizer.
"""

from __future__ import annotations

import numpy as np
import optax
from absl import flags

import pallas_emb as pe

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 500, "Training steps.")
flags.DEFINE_float(
  "epochs",
  None,
  "Train for this many passes over the training set instead of "
  "--steps (datasets with a finite training set: MovieLens).",
)
flags.DEFINE_integer(
  "early_stop_patience",
  0,
  "Stop after this many evaluations (--eval_every) "
  "in a row without a lower eval log-loss (0: never).",
)
flags.DEFINE_string("tensorboard_dir", None, "Write TensorBoard scalars (tensorboardX) here.")
flags.DEFINE_integer(
  "history_len", 50, "MovieLens: the user's earlier ratings in the history bag (0: no history)."
)
flags.DEFINE_float(
  "validation_fraction",
  0.0,
  "MovieLens: evaluate on this share of all ratings just before the evaluation window "
  "(the latest 10%), train on those before it, and never read the evaluation window: "
  "choose settings here (0: evaluate on the evaluation window).",
)
flags.DEFINE_enum(
  "model",
  "auto",
  ["auto", "mlp", "factorization"],
  "mlp: an MLP over the concatenated embeddings (pallas_emb.job.model); factorization: "
  "biases and <history, item> (pallas_emb.job.factorization); auto: factorization on "
  "--data=movielens, mlp otherwise.",
)
flags.DEFINE_bool(
  "baselines",
  True,
  "MovieLens: also score item popularity and a logistic "
  "regression on user and item ids on the same split.",
)
flags.DEFINE_integer("batch_size", 1024, "Global batch size (a multiple of the device count).")
flags.DEFINE_string(
  "data",
  "synthetic",
  "'synthetic' or 'movielens:PATH' (u.data, ratings.dat, ratings.csv or RecBole's .inter).",
)
flags.DEFINE_integer(
  "devices",
  None,
  "Devices per process in the mesh (default: all of them; on CPU "
  "8 simulated devices, or this many).",
)
flags.DEFINE_enum(
  "backend",
  None,
  ["xla", "native", "interpret", "pallas"],
  "Kernel backend; default: pallas on TPU, native on CPU (when its library is built), "
  "xla elsewhere.",
)
flags.DEFINE_bool(
  "async_emb",
  True,
  "Train tables with the fused asynchronous update (--noasync_emb: synchronous sparse update).",
)
flags.DEFINE_bool(
  "exact_emb",
  False,
  "With --async_emb, apply each step's embedding gradient within the step (no staleness).",
)
flags.DEFINE_enum(
  "optimizer",
  "rowwise_adagrad",
  ["rowwise_adagrad", "adagrad", "sgd", "lazy_adam", "ftrl", "optax_adam"],
  "Embedding optimizer (optax_adam has no fused update: it needs --noasync_emb).",
)
flags.DEFINE_float(
  "emb_learning_rate", None, "Embedding learning rate; default per optimizer and --model."
)
flags.DEFINE_float(
  "dense_learning_rate",
  1e-3,
  "Adam learning rate of the dense parameters (the MLP; the factorization's global bias).",
)
flags.DEFINE_integer(
  "emb_dim", 16, "Width of every embedding table (--workload=dlrm: by vocabulary)."
)
flags.DEFINE_enum(
  "workload",
  "default",
  ["default", "dlrm"],
  "default: the tables of --data; dlrm: "
  "26 Criteo-shaped tables (rows capped by --dlrm_max_rows, D=16..128, "
  "pallas_emb.data.dlrm) with synthetic clicks.",
)
flags.DEFINE_integer(
  "dlrm_max_rows", 20_000, "--workload=dlrm: cap of every table's rows (0: Criteo's)."
)
flags.DEFINE_enum(
  "stacking",
  "auto",
  ["auto", "off"],
  "Store tables of equal dim and optimizer as one (pallas_emb.stacking) or each alone.",
)
flags.DEFINE_enum(
  "vocabulary",
  "static",
  ["static", "dynamic"],
  "static: a row per id of the data; dynamic: the user and item tables take the data's raw ids, "
  "admitted into --capacity rows as they arrive (pallas_emb.DynamicVocabulary).",
)
flags.DEFINE_integer(
  "capacity", 0, "--vocabulary=dynamic: rows of each dynamic table (0: the static table's rows)."
)
flags.DEFINE_integer(
  "admit_after", 2, "--vocabulary=dynamic: occurrences of an id before it takes a row."
)
flags.DEFINE_enum(
  "policy",
  "lfu",
  ["lfu", "lru"],
  "--vocabulary=dynamic: which resident id loses its row to a new one (least frequently or "
  "least recently used).",
)
flags.DEFINE_string("checkpoint_dir", None, "Directory for orbax checkpoints.")
flags.DEFINE_integer(
  "checkpoint_every", 0, "Checkpoint every N steps (0: only at the end, if --checkpoint_dir)."
)
flags.DEFINE_bool("resume", False, "Continue from the latest checkpoint in --checkpoint_dir.")
flags.DEFINE_integer("eval_every", 0, "Evaluate every N steps (0: only at the end).")
flags.DEFINE_integer(
  "eval_batches", 0, "Evaluate on at most this many batches (0: the whole held-out set)."
)
flags.DEFINE_integer("log_every", 50, "Print progress every N steps.")
flags.DEFINE_string("report_json", None, "Write the final report to this JSON file.")
flags.DEFINE_string(
  "save_tables", None, "Write the final tables (logical row order) to this .npz file."
)
flags.DEFINE_string(
  "export_dir",
  None,
  "At the end, write a serving artifact here (pallas_emb.export_serving), load it back and "
  "evaluate through it as well as through the training lookup.",
)
flags.DEFINE_integer("seed", 0, "Seed of the data and the initial parameters.")
flags.DEFINE_bool(
  "debug",
  False,
  "Show the traceback of the library's own errors (also PALLAS_EMB_DEBUG=1); "
  "without it they are one line with their fix.",
)
flags.DEFINE_bool(
  "keep_freed_memory",
  True,
  "Keep freed heap memory between steps (XLA:CPU "
  "reallocates its temporaries each step; see pallas_emb.job.host_memory).",
)
flags.DEFINE_string(
  "coordinator_address", None, "Multi-host: host:port of process 0 (or JAX_COORDINATOR_ADDRESS)."
)
flags.DEFINE_integer(
  "num_processes", None, "Multi-host: number of processes (or JAX_NUM_PROCESSES)."
)
flags.DEFINE_integer("process_id", None, "Multi-host: this process's index (or JAX_PROCESS_ID).")
flags.DEFINE_integer(
  "heartbeat_timeout",
  10,
  "Multi-host: seconds without a heartbeat after which a "
  "process counts as lost (a process that dies is noticed within about a second).",
)


def _require(name: str, ok, limit: str, fix: str) -> None:
  """Refuses --name unless ok(value), at parse time, before JAX sees it."""
  flags.register_validator(name, ok, message=f"--{name} must be {limit}; {fix}")


for _name, _low, _fix in (
  ("steps", 1, "it is the number of training steps"),
  ("batch_size", 1, "it is the global batch (a multiple of the device count)"),
  ("emb_dim", 1, "it is the width of every table"),
  ("log_every", 1, "it is the progress period in steps"),
  ("checkpoint_every", 0, "0 checkpoints only at the end"),
  ("eval_every", 0, "0 evaluates only at the end"),
  ("early_stop_patience", 0, "0 never stops early"),
  ("history_len", 0, "0 drops the history feature"),
  ("eval_batches", 0, "0 evaluates the whole held-out set"),
  ("seed", 0, "it seeds the data and the initial parameters"),
  ("heartbeat_timeout", 1, "it is in seconds"),
  ("devices", 1, "omit it to use every device of the process"),
  ("num_processes", 1, "omit it for one process"),
  ("process_id", 0, "it counts from 0"),
):
  _require(_name, lambda v, low=_low: v is None or v >= low, f"an integer >= {_low}", _fix)
for _name, _fix in (
  ("emb_learning_rate", "omit it for the optimizer's default"),
  ("dense_learning_rate", "it is Adam's step size for the dense parameters"),
):
  _require(_name, lambda v: v is None or (np.isfinite(v) and v >= 0), "a finite number >= 0", _fix)
flags.register_multi_flags_validator(
  ["process_id", "num_processes"],
  lambda f: None in (f["process_id"], f["num_processes"]) or f["process_id"] < f["num_processes"],
  message="--process_id must be below --num_processes; processes are numbered 0 .. N-1.",
)
_require(
  "validation_fraction",
  lambda v: np.isfinite(v) and 0 <= v < 0.9,
  "in [0, 0.9)",
  "it is the share of all ratings before the latest 10% that evaluates instead of them",
)
_require(
  "epochs",
  lambda v: v is None or (np.isfinite(v) and v > 0),
  "a finite number > 0",
  "omit it to train for --steps",
)
flags.register_multi_flags_validator(
  ["early_stop_patience", "eval_every"],
  lambda f: not f["early_stop_patience"] or f["eval_every"],
  message="--early_stop_patience needs --eval_every: it counts evaluations without progress.",
)
flags.register_multi_flags_validator(
  ["resume", "checkpoint_dir"],
  lambda f: not f["resume"] or f["checkpoint_dir"],
  message="--resume needs --checkpoint_dir: the directory to resume from.",
)

# FTRL's rate is lr / sqrt(accumulator) and its first touch replaces a row's
# initial value: on the synthetic log (500 steps) eval AUC rose from 0.728 at
# lr 0.05 to 0.752 at 5.0 (row-wise Adagrad at 0.05: 0.755).
DEFAULT_LR = {
  "rowwise_adagrad": 0.05,
  "adagrad": 0.05,
  "sgd": 0.5,
  "lazy_adam": 0.005,
  "ftrl": 5.0,
  "optax_adam": 0.005,
}


# The factorization model's own rate where it was tuned: on ml-100k's
# validation window row-wise Adagrad reached AUC 0.725 in five epochs at
# 0.05, 0.729 at 0.1, 0.728 at 0.15, 0.727 at 0.2. Other optimizers keep
# DEFAULT_LR.
FACTORIZATION_LR = {"rowwise_adagrad": 0.1}


def embedding_optimizer(name: str, lr: float | None = None, model: str = "mlp"):
  """The optimizer --optimizer names, at `lr` (None: its default for
  `model`, "mlp" or "factorization")."""
  if lr is None:
    lr = (FACTORIZATION_LR if model == "factorization" else DEFAULT_LR).get(name, DEFAULT_LR[name])
  return {
    "rowwise_adagrad": lambda: pe.RowWiseAdagrad(lr, eps=1e-8, half_life_steps=None),
    "adagrad": lambda: pe.Adagrad(lr),
    "sgd": lambda: pe.SGD(lr),
    "lazy_adam": lambda: pe.LazyAdam(lr),
    "ftrl": lambda: pe.FTRL(lr),
    "optax_adam": lambda: pe.OptaxRows(optax.adam(lr)),
  }[name]()
