"""The training step compiled for real TPU topologies, on this CPU machine.

libtpu (from the test extra) compiles deviceless, without network access
(`unshare -n`), in two processes that take the cases one at a time and run
each as `python -m pallas_emb.pod_check ARGS` would (its `main`). The
compiles run as the module's first test asks for them, and the tests read
their reports:

* the main job's async step compiles with the block kernels for v5e (its
  own D=16), v6e and v5p (D=128);
* W-TPU (one 1M-row table, D=128 f32, `item` + 20-id `history`, on v5e:2x2)
  fits in twice its working set, copies no table or slot, and its update's
  all-to-all overlaps the dense compute;
* a dynamic-vocabulary table (`--dynamic`) keeps its update in the
  kernels, with no copy of the table or its slots;
* per-chip memory follows the ids, not the table or the chip count: the same
  batch with a 10x table, and 4x the chips with the same shard, keep temp
  flat.

* every table shape: W-TPU's step for D in {16, 128} x {float32,
  bfloat16} x {RowWiseAdagrad, LazyAdam} (a pairwise subset: each pair of
  values in one case), and FTRL, Adagrad and SGD at D=32, and the padded
  widths float32 D=96 and bfloat16 D=192 with RowWiseAdagrad, on v5e, runs
  its update in the block kernel (`--forms=block`) and fits the bound on
  temp (the grid's rest runs under `-m grid`: the other half of the product,
  v6e, D in {32, 64}, the other padded cases, LazyAdam at the padded
  widths);
* `OptaxRows`, whose math runs in XLA, moves its rows through the block
  kernels and copies no table or slot (D=16; D=128 under `-m grid`);
* the main job at its own D=16 and the DLRM configuration (26 tables, 4
  stacks) update every table in the block kernel and copy none (and, under
  `-m grid`, the main job at D=128 on v5e and with FTRL);
* the cost model's forms (`--forms=auto`, the default) are in every report:
  W-TPU's 256 examples per chip take XLA's scatter, as measured.
* the all-to-alls' charge in XLA's cost model, probed op by op (`probes`).

Each step compiles in 2 to 15 s (DLRM's the longest), and the compiles are
a third of CI's CPU time, so CI compiles a case for each thing checked and
the grid compiles the rest.

These compile at small batches: 256 examples per chip (W-TPU, which is also
the small end of the scaling pair, and the configuration file), 64 for the
shapes and the dynamic table (its map's compile takes 18 s at 256, 10 s at
64).
A compile's time grows with the batch (W-TPU's 4,096 examples per chip take
47 CPU-s, 256 take 10), and the assertions are relative to the ids: at a
small batch a table-sized or fixed buffer stands out the more (W-TPU's temp
is 0.55 of its bound at 256, 0.34 at 4,096; at either, each of its three
kernels is one call, all its ids in one SMEM window).
`python -m pallas_emb.pod_check --workload=w_tpu` compiles the full 4,096.
"""

import concurrent.futures
import importlib.util
import json
import os
import queue
import subprocess
import sys

import pytest

MIB = 2**20
EXAMPLE_CONFIG = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "pod_check_example.json"
)


def _can_unshare() -> bool:
  try:
    return (
      subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30).returncode == 0
    )
  except (OSError, subprocess.TimeoutExpired):
    return False


# libtpu comes with the test extra: its absence is a broken install, not a
# reason to skip. A machine that may not create a network namespace cannot
# run the compile the way the project requires.
pytestmark = [
  pytest.mark.slow,
  pytest.mark.skipif(
    not _can_unshare(),
    reason="`unshare -n` is not permitted here: the deviceless TPU compile "
    "runs only without network access",
  ),
]


def _kernel_shapes(*flags: str, topology: str = "v5e:2x2") -> list[str]:
  """W-TPU's step at 4M rows and 64 examples per chip, every update in the
  block kernel (`--forms=block`), with `flags`: its widths, dtypes and
  optimizers. 4M rows, so that a whole-shard buffer of even the narrowest
  table (D=16 bfloat16: 31 MiB) would exceed the temp bound."""
  return [
    f"--topology={topology}",
    "--workload=w_tpu",
    "--vocab=4000000",
    "--examples_per_chip=64",
    "--forms=block",
    *flags,
  ]


def _main_d128(*flags: str, topology: str = "v5e:2x2") -> list[str]:
  """The main job's step with D=128 tables in the block kernels."""
  return [
    f"--topology={topology}",
    "--workload=main",
    "--dim=128",
    "--examples_per_chip=128",
    "--forms=block",
    *flags,
  ]


# The shape product's pairwise half: each pair of (dtype, width, optimizer)
# values is in one case; the other half is the grid's.
SHAPES = [
  ("float32", 16, "rowwise_adagrad"),
  ("float32", 128, "lazy_adam"),
  ("bfloat16", 16, "lazy_adam"),
  ("bfloat16", 128, "rowwise_adagrad"),
]
SHAPES_REST = [
  ("float32", 16, "lazy_adam"),
  ("float32", 128, "rowwise_adagrad"),
  ("bfloat16", 16, "rowwise_adagrad"),
  ("bfloat16", 128, "lazy_adam"),
]


def _shape_cases(prefix: str, shapes) -> dict[str, list[str]]:
  return {
    f"{prefix}_{dtype}_d{dim}_{opt}": _kernel_shapes(
      f"--dtype={dtype}", f"--dim={dim}", f"--optimizer={opt}"
    )
    for dtype, dim, opt in shapes
  }


COMPILES = {
  # v5e's main job is main_d16's.
  "main": _main_d128(topology="v6e:2x2,v5p:2x2x1"),
  # W-TPU's table with a dynamic vocabulary, beside the same step static.
  "dynamic": [
    "--topology=v5e:2x2",
    "--workload=w_tpu",
    "--vocab=1000000",
    "--examples_per_chip=64",
    "--dynamic",
    "--forms=block",
  ],
  # W-TPU, and the small end of the scaling pair.
  "w_tpu": [
    "--topology=v5e:2x2",
    "--workload=w_tpu",
    "--vocab=1000000",
    "--examples_per_chip=256",
  ],
  "large_table": [
    "--topology=v5e:2x2",
    "--workload=w_tpu",
    "--vocab=10000000",
    "--examples_per_chip=256",
  ],
  "more_chips": [
    "--topology=v5e:4x4",
    "--workload=w_tpu",
    "--vocab=4000000",
    "--examples_per_chip=256",
  ],
  # docs/pod_check_example.json: a bf16 LazyAdam user table (D=64, rounded
  # stochastically), an f32 Adagrad item table (D=32) and a 256-row SGD table.
  # The file's 1,024 examples per chip overridden: the assertion is relative.
  "config": ["--topology=v5e:2x2", f"--config={EXAMPLE_CONFIG}", "--examples_per_chip=256"],
  # Every table shape on the kernel path: W-TPU's step for each width,
  # dtype and optimizer.
  **_shape_cases("shapes", SHAPES),
  # Widths stored padded (96 -> 128 words, 192 -> 256; bf16 96 -> 64 words
  # packed 2 to a row, 192 -> 128): on the kernel path too.
  "padded_f32": _kernel_shapes("--dtype=float32", "--dim=96", "--optimizer=rowwise_adagrad"),
  "padded_bf16": _kernel_shapes("--dtype=bfloat16", "--dim=192", "--optimizer=rowwise_adagrad"),
  "optimizers": _kernel_shapes("--dim=32", "--optimizer=ftrl,adagrad,sgd"),
  # OptaxRows (optax.adam per row): its math in XLA, its rows through the
  # kernels (kernels.staged_update); synchronous only.
  "optax_rows": _kernel_shapes("--pipelines=sync", "--dim=16", "--optimizer=optax_rows"),
  # The main job as it runs (D=16 tables) and the DLRM configuration's 26
  # tables (D=16..128, rows capped at 20k).
  "main_d16": ["--topology=v5e:2x2", "--workload=main", "--examples_per_chip=128", "--forms=block"],
  "dlrm": ["--topology=v5e:2x2", "--workload=dlrm", "--examples_per_chip=128", "--forms=block"],
}
# The grid's rest, under `-m grid`: the shape product's other half, v6e for
# every shape, D in {32, 64}, the other padded cases and LazyAdam at the
# padded widths, OptaxRows at D=128, and the main job at D=128 on v5e and
# with FTRL.
GRID_COMPILES = {
  **_shape_cases("shapes_rest", SHAPES_REST),
  **_shape_cases(
    "padded_rest", [("float32", 192, "rowwise_adagrad"), ("bfloat16", 96, "rowwise_adagrad")]
  ),
  "shapes_v6e": _kernel_shapes(
    "--dtype=float32,bfloat16",
    "--dim=16,32,64,128",
    "--optimizer=rowwise_adagrad,lazy_adam",
    topology="v6e:2x2",
  ),
  "shapes_d32_d64": _kernel_shapes(
    "--dtype=float32,bfloat16", "--dim=32,64", "--optimizer=rowwise_adagrad,lazy_adam"
  ),
  "padded_lazy_adam": _kernel_shapes(
    "--dtype=float32,bfloat16", "--dim=96,192", "--optimizer=lazy_adam"
  ),
  "optax_rows_d128": _kernel_shapes("--pipelines=sync", "--dim=128", "--optimizer=optax_rows"),
  "main_v5e": _main_d128(),
  "ftrl": _main_d128("--optimizer=ftrl"),
}


# One compile process per worker thread, fed one case at a time (a JSON
# argument list per line of stdin, "done" on stdout after each): the cases
# share the interpreter's, JAX's and libtpu's start, about 2 s a process.
RUNNER = """
import json, sys
from pallas_emb.pod_check.__main__ import main
for line in sys.stdin:
  main(json.loads(line))
  print("done", flush=True)
"""


def _compile_cases(tmp, cases: queue.Queue, worker: int) -> dict:
  """Compiles cases from `cases` in one process until none is left."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the test process's simulated CPU devices
  # Two compiles at a time: libtpu's lock file must not serialise them.
  env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
  log = tmp / f"worker{worker}.stderr"
  cmd = ["timeout", "-k", "5", "900", "unshare", "-n", sys.executable, "-c", RUNNER]
  reports = {}
  with (
    open(log, "w") as err,
    subprocess.Popen(
      cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
    ) as proc,
  ):
    while True:
      try:
        name, args = cases.get_nowait()
      except queue.Empty:
        break
      out = tmp / f"{name}.json"
      proc.stdin.write(json.dumps(["--pipelines=async", f"--json={out}", *args]) + "\n")
      proc.stdin.flush()
      printed = []
      while (line := proc.stdout.readline()) not in ("done\n", ""):
        printed.append(line)
      assert line, f"{name}: {''.join(printed)[-2000:]}\n{log.read_text()[-4000:]}"
      reports[name] = json.loads(out.read_text())
    proc.stdin.close()
  return reports


def _compile_all(tmp_path_factory, compiles):
  assert importlib.util.find_spec("libtpu") is not None, (
    "libtpu is missing: the test extra installs jax[tpu]"
  )
  tmp = tmp_path_factory.mktemp("pod_check")
  cases = queue.Queue()
  for item in compiles.items():
    cases.put(item)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    done = list(pool.map(lambda w: _compile_cases(tmp, cases, w), range(2)))
  reports = {k: v for d in done for k, v in d.items()}
  return {name: reports[name] for name in compiles}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
  return _compile_all(tmp_path_factory, COMPILES)


def _assert_block_kernels(r, case):
  """Every physical table updated by one block kernel call (the gather of a
  table sharded over several chips is XLA's: its rows are not one ascending
  run), the report says so, and no table or slot is copied or staged into
  VMEM around the kernels (their operands are stated in HBM)."""
  assert r["backend"] == "pallas", case
  assert r["kernels"].get("_block_update_call") == r["physical_tables"], (case, r["kernels"])
  assert sum(r["kernels"].values()) == r["kernel_calls"], (case, r["kernels"])
  for table in r["tables"].values():
    assert table["forms"] == {"update": "block", "gather": "xla"}, (case, table["forms"])
    assert not table["copies"] and not table["prefetches"], (case, table)


def _assert_no_table_copy(name, table):
  """No table or slot relaid out; on XLA's forms XLA may stage a slot that
  fits VMEM beside its scatter (a per-row scalar's: 1 MiB for 250k rows),
  never the table."""
  assert not table["copies"], (name, table)
  shard = f"[{table['rows_per_chip']},"
  assert not [p for p in table["prefetches"] if shard in p], (name, table["prefetches"])
  if table["forms"]["update"] == "block":
    assert not table["prefetches"], (name, table["prefetches"])


def test_main_job_async_step_compiles_for_v5e_v6e_v5p(reports):
  got = reports["main_d16"] + reports["main"]
  assert [r["topology"] for r in got] == ["v5e:2x2", "v6e:2x2", "v5p:2x2x1"]
  for r in got:
    assert r["backend"] == "pallas" and r["chips"] == 4
    # The three tables are stacked into one physical table
    # (pallas_emb.stacking): its fused update in the block kernel.
    assert r["physical_tables"] == 1
    _assert_block_kernels(r, r["topology"])


def test_a_configuration_file_compiles_each_table_as_configured(reports):
  [r] = reports["config"]
  assert r["backend"] == "pallas" and r["physical_tables"] == 3, r
  # --examples_per_chip overrides the file's 1,024: 23 ids per example.
  assert r["ids_per_chip"] == 256 * 23, r["ids_per_chip"]
  got = {
    n: (t["dim"], t["dtype"], t["optimizer"], t["stochastic_rounding"])
    for n, t in r["tables"].items()
  }
  assert got == {
    "user": (64, "bfloat16", "LazyAdam", True),
    "item": (32, "float32", "Adagrad", False),
    "country": (16, "float32", "SGD", False),
  }
  # The cost model's forms (the default, --forms=auto): the three tables
  # are packed (32, 32 and 16 words a row), whose XLA update would copy the
  # whole table every step, so all three take the block update; none is
  # copied.
  forms_ = {n: t["forms"]["update"] for n, t in r["tables"].items()}
  assert forms_ == {"user": "block", "item": "block", "country": "block"}, forms_
  assert r["kernels"].get("_block_update_call", 0) == 3, r["kernels"]
  for name, table in r["tables"].items():
    _assert_no_table_copy(name, table)
  # Per-chip temp follows the ids: rows received and gradients sent, here
  # still 128 lanes wide per id (the per-id buffers of narrow rows are not
  # packed yet), plus 16 MiB.
  lane_padded_working_set = 2 * r["ids_per_chip"] * 128 * 4
  assert r["temp_bytes"] <= lane_padded_working_set + 16 * MIB, r["temp_bytes"] / MIB


def test_w_tpu_fits_twice_its_working_set_and_copies_no_table_or_slot(reports):
  [r] = reports["w_tpu"]
  assert r["ids_per_chip"] == 256 * 21
  row_bytes = 128 * 4
  working_set = 2 * r["ids_per_chip"] * row_bytes  # rows received + grads sent
  assert r["temp_bytes"] <= 2 * working_set, r["temp_bytes"] / MIB
  item = r["tables"]["item"]
  # At 256 examples per chip (5,376 ids) the model picks XLA's scatter over a
  # sweep of the 250k-row shard (the chip measured the crossover between).
  assert item["forms"] == {"update": "xla", "gather": "xla"}, item["forms"]
  _assert_no_table_copy("item", item)
  # The table update's gradient all-to-all runs while the dense model
  # computes (async collectives, libtpu's async all-to-all on).
  update = [p for p in r["overlap"]["pairs"] if p["program"] == "apply_token_gradients"]
  assert update and all(p["dense_ops_between"] > 0 for p in update), r["overlap"]


def test_every_table_shape_and_optimizer_runs_in_the_kernels(reports):
  got = [r for name in COMPILES if name.startswith(("shapes", "padded")) for r in reports[name]]
  got += reports["optimizers"]
  cases = {(t["dim"], t["dtype"], t["optimizer"]) for r in got for t in r["tables"].values()}
  assert len(got) == len(cases) == len(SHAPES) + 2 + 3, sorted(cases)
  _assert_shapes(got)


def _assert_shapes(got):
  for r in got:
    [table] = r["tables"].values()
    case = (r["topology"], table["dim"], table["dtype"], table["optimizer"])
    _assert_block_kernels(r, case)
    row_bytes = table["dim"] * (2 if table["dtype"] == "bfloat16" else 4)
    working_set = 2 * r["ids_per_chip"] * row_bytes  # rows received + grads sent
    bound = max(2 * working_set, working_set + 16 * MIB)
    assert r["temp_bytes"] <= bound, (case, r["temp_bytes"] / MIB, bound / MIB)


@pytest.mark.grid
def test_the_rest_of_the_shape_grid_runs_in_the_kernels(tmp_path_factory):
  got = _compile_all(tmp_path_factory, GRID_COMPILES)
  shapes = [r for name, rs in got.items() if name.startswith(("shapes", "padded")) for r in rs]
  _assert_shapes(shapes)
  # v5e: the rest of D in {16, 128} (4), D in {32, 64} (8), the padded
  # widths' rest (2 + 4); v6e: every width, dtype and optimizer (16).
  cases = {
    (r["topology"], t["dim"], t["dtype"], t["optimizer"])
    for r in shapes
    for t in r["tables"].values()
  }
  assert len(shapes) == len(cases) == 4 + 8 + 2 + 4 + 16, sorted(cases)
  for r in got["optax_rows_d128"]:
    _assert_optax_rows(r)
  [v5e], [ftrl] = got["main_v5e"], got["ftrl"]
  for r in (v5e, ftrl):
    # The three tables are one stack (FTRL: two full-width slots, no per-row
    # scalar), updated by the block kernel.
    assert r["physical_tables"] == 1, r
    _assert_block_kernels(r, r["workload"])


@pytest.mark.parametrize("name", ["main_d16", "dlrm"])
def test_main_job_and_dlrm_run_every_table_in_the_kernels_and_copy_none(reports, name):
  [r] = reports[name]
  # Each physical table (a stack of the logical ones) is updated by one
  # block kernel call.
  _assert_block_kernels(r, name)


def test_optax_rows_moves_its_rows_through_the_kernels_and_no_shard(reports):
  for r in reports["optax_rows"]:
    _assert_optax_rows(r)


def _assert_optax_rows(r):
  [table] = r["tables"].values()
  case = (table["dim"], table["optimizer"])
  assert table["optimizer"] == "OptaxRows" and r["pipeline"] == "sync", case
  # The table and Adam's three slots (count, mu, nu): each read by the
  # block gather and written back by the block update.
  assert r["kernels"].get("_block_update_call") == 4, (case, r["kernels"])
  assert r["kernels"].get("_block_gather_call") == 4, (case, r["kernels"])
  # On the XLA path XLA staged both moment slots into VMEM in slices and
  # its temp grew with the table (247 MiB for these 4M rows at D=16).
  assert not table["copies"] and not table["prefetches"], (case, table)
  assert r["temp_bytes"] < table["table_bytes"] / 4, (case, r["temp_bytes"] / MIB)


def test_the_cost_models_all_to_all_overcharge_is_probed_op_by_op(reports):
  [r] = reports["w_tpu"]
  charges = r["collective_charges"]
  # The lookup's ids and rows, the update's gradients.
  assert len(charges) == 3, charges
  for c in charges:
    # What moves is the block read once and written once; the isolated
    # op is charged at least that.
    assert c["moved"] == 2 * c["bytes"] and c["charged"] >= c["moved"], c
  excess = sum(c["charged"] - c["moved"] for c in charges)
  assert r["net_bytes_accessed"] == pytest.approx(r["bytes_accessed"] - excess)
  assert r["net_bytes_accessed"] < r["bytes_accessed"]


def test_per_chip_temp_follows_the_ids_not_the_table_or_the_chip_count(reports):
  [small], [large], [more] = (reports[k] for k in ("w_tpu", "large_table", "more_chips"))
  assert large["tables"]["item"]["table_bytes"] > 9 * small["tables"]["item"]["table_bytes"]
  assert large["temp_bytes"] <= 1.1 * small["temp_bytes"], (
    small["temp_bytes"],
    large["temp_bytes"],
  )
  assert more["chips"] == 16
  assert more["tables"]["item"]["rows_per_chip"] == small["tables"]["item"]["rows_per_chip"]
  assert more["temp_bytes"] <= 1.2 * small["temp_bytes"], (small["temp_bytes"], more["temp_bytes"])


def test_a_dynamic_vocabulary_keeps_the_table_in_the_kernels(reports):
  dynamic, static = reports["dynamic"]
  assert (dynamic["pipeline"], static["pipeline"]) == ("dynamic", "static")
  assert dynamic["tables"]["item"]["dynamic_vocabulary"]
  assert not static["tables"]["item"]["dynamic_vocabulary"]
  # The id map only translates raw ids into rows before the static path:
  # the fused update is the static step's block kernel, and neither step
  # relays the table or a slot out.
  _assert_block_kernels(static, "static")
  assert dynamic["kernels"] == static["kernels"] == {"_block_update_call": 1}, dynamic["kernels"]
  assert not dynamic["tables"]["item"]["copies"], dynamic["tables"]["item"]
  # The new rows' reset (an XLA scatter) may stage the 1 MiB accumulator
  # into VMEM, never the table.
  table = f"f32[{dynamic['tables']['item']['rows_per_chip']},128]"
  assert not [p for p in dynamic["tables"]["item"]["prefetches"] if table in p]
  # The map's own work is beside the static step's temp, not instead of it.
  assert dynamic["temp_bytes"] > static["temp_bytes"]
