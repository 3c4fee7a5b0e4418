"""Faults and misuse: every case is a typed error or an exact result.

Checkpoints: bit flips at random offsets, truncated and deleted files,
tampered metadata, an interrupted save, SIGKILL during a save, directories
that cannot be written, and restores into another configuration. Misuse of
the API: empty batches and bags, ids and tables on the wrong devices, an
async update handed to another table, and out-of-range flags. Restores are
compared bit for bit with the state that was saved.
"""

import dataclasses
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from absl import flags
from conftest import make_mesh, small_trainer
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_emb as pe
from pallas_emb import async_emb, verify
from pallas_emb import data as data_lib
from pallas_emb.data.feed import GlobalBatches
from pallas_emb.errors import (
  CheckpointCorruptError,
  CheckpointDirError,
  CheckpointError,
  CheckpointMismatchError,
  EmptyInputError,
  MeshMismatchError,
  PlacementError,
  UpdateMismatchError,
)
from pallas_emb.job import run as main_lib
from pallas_emb.job.model import build_ranking
from pallas_emb.train import checkpoint_files, integrity
from pallas_emb.train.checkpoint import Checkpointer
from pallas_emb.train.checkpoint_dir import CheckpointDir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 64

# orbax's failed read of a file with flipped bits leaves callbacks on a
# closed event loop ("Event loop is closed"); the read itself fails cleanly
# and is checked. (A short or missing file is found before orbax reads.)
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _trainer(optimizer=None, batch=BATCH, user_rows=500, devices=8, config=pe.TrainConfig()):
  """conftest's small job, or one like it with another optimizer, batch,
  table, device count or pipeline."""
  if (optimizer, batch, user_rows, devices, config) == (None, BATCH, 500, 8, pe.TrainConfig()):
    return small_trainer()
  dataset = data_lib.SyntheticClickLog(num_users=user_rows, num_items=300, eval_examples=256)
  emb, model = build_ranking(
    dataset,
    make_mesh(devices),
    emb_dim=8,
    backend="xla",
    optimizer=optimizer or pe.RowWiseAdagrad(0.05, half_life_steps=None),
  )
  feeder = GlobalBatches(dataset, batch, emb.sharding())
  trainer = pe.make_trainer(emb, model.loss, optax.adam(1e-3), config, feeder.train(0))
  return trainer, model, feeder


def _host(tr, state) -> dict:
  """Everything a restore must bring back, as host arrays."""
  out = {"step": int(state.step)}
  for t in tr.emb.tables:  # logical tables
    out[f"{t.name}/table"] = tr.emb.logical_table(state.tables, t.name)
    for k, v in tr.emb.logical_slots(state.tables, t.name).items():
      out[f"{t.name}/{k}"] = v
  for name in state.tables:  # physical tables
    out[f"{name}/pending"] = np.asarray(state.pending[name].pending)
    out[f"{name}/grads"] = np.asarray(state.pending[name].grads)
    out[f"{name}/step"] = np.asarray(state.tables[name].step)
  for i, leaf in enumerate(jax.tree.leaves((state.params, state.opt_state))):
    out[f"dense/{i}"] = np.asarray(leaf)
  return out


def _assert_same(got: dict, want: dict):
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A trainer, steps 1, 2, 3 checkpointed in a pristine directory, and the
  host copy of the state at each step."""
  tr, model, feeder = _trainer()
  init = lambda: tr.init(
    model.init(jax.random.key(1)), tr.emb.init(jax.random.key(2)), feeder.train(0)
  )
  state, refs = init(), {}
  directory = str(tmp_path_factory.mktemp("pristine"))
  ckpt = Checkpointer(directory, tr)
  shapes = {f.name: (BATCH, f.bag_size) for f in feeder.dataset.features}
  for t in range(3):
    state, _ = tr.step(state, feeder.train(t), feeder.train(t + 1))
    ckpt.save(state, shapes)
    refs[t + 1] = _host(tr, state)
  return dict(
    trainer=tr, feeder=feeder, template=init(), dir=directory, refs=refs, shapes=shapes, state=state
  )


def _copy(saved, tmp_path) -> str:
  work = str(tmp_path / "ckpt")
  shutil.copytree(saved["dir"], work)
  return work


def _restore(saved, directory, step=None):
  ckpt = Checkpointer(directory, saved["trainer"])
  return ckpt.restore_verified(saved["template"], saved["feeder"].train, step)


def _files(directory, step, data_only=False):
  root = os.path.join(directory, str(step))
  files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
  if data_only:
    files = [f for f in files if f"{os.sep}d{os.sep}" in f]
  return files


def _expect_newest_intact(saved, directory, corrupted_step=3):
  """The restore is the corrupted step itself, exactly (the damage missed
  every byte that is read), or the step before it, exactly, with the
  corrupted one skipped, named and moved aside."""
  r = _restore(saved, directory)
  assert r.step in (corrupted_step, corrupted_step - 1)
  if r.step == corrupted_step - 1:
    assert [s for s, _ in r.skipped] == [corrupted_step] and r.skipped[0][1]
    assert os.path.isdir(os.path.join(directory, f"{corrupted_step}.corrupt"))
  _assert_same(_host(saved["trainer"], r.state), saved["refs"][r.step])
  return r


# -- checksums -----------------------------------------------------------------------


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(
  dtype=st.sampled_from(
    [np.float32, np.int32, np.uint8, np.int8, np.float16, np.bool_, jnp.bfloat16, np.uint32]
  ),
  rows=st.sampled_from([8, 16]),
  seed=st.integers(0, 2**16),
  flip=st.integers(0, 10**6),
)
def test_checksum_is_the_same_on_devices_and_host_and_sees_one_bit(dtype, rows, seed, flip):
  values = np.abs(np.random.default_rng(seed).normal(size=(rows, 5)) * 100)
  x = values > 80 if dtype == np.bool_ else values.astype(dtype)
  sharded = jax.device_put(
    x, jax.sharding.NamedSharding(make_mesh(8), jax.sharding.PartitionSpec("x"))
  )
  got = integrity.checksums({"a": sharded, "b": jax.device_put(x, jax.devices()[0]), "c": x})
  assert got["a"] == got["b"] == got["c"] == integrity.host_checksum(x)
  bits = np.ascontiguousarray(x).view(np.uint8).copy()
  bits.reshape(-1)[flip % bits.size] ^= 1 << (flip % 8)
  assert integrity.host_checksum(bits.view(x.dtype).reshape(x.shape)) != got["c"]
  if x.size > 1 and not np.all(x.reshape(-1)[0] == x.reshape(-1)[1]):
    swapped = x.copy().reshape(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert integrity.host_checksum(swapped.reshape(x.shape)) != got["c"]


# -- checkpoint corruption ---------------------------------------------------------


# The quick loop's subset (conftest): two of the six random offsets.
QUICK = {"test_bit_flip_at_a_random_offset_is_found": lambda p: p["seed"] < 2}


@pytest.mark.parametrize("seed", range(6))
def test_bit_flip_at_a_random_offset_is_found(saved, tmp_path, seed):
  work = _copy(saved, tmp_path)
  rng = random.Random(seed)
  path = rng.choice(_files(work, 3, data_only=seed % 2 == 0))
  data = bytearray(open(path, "rb").read())
  offset = rng.randrange(len(data))
  data[offset] ^= 1 << rng.randrange(8)
  open(path, "wb").write(data)
  _expect_newest_intact(saved, work)


def test_flipped_table_value_is_skipped_with_its_array_named(saved, tmp_path):
  # Rewrite one saved table value through orbax itself (valid encoding, a
  # different number): only the checksums can tell.
  work = _copy(saved, tmp_path)
  d = CheckpointDir(work)
  meta = d.read_meta(3)
  target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), d.manager.item_metadata(3)["state"])
  item = d.manager.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))[
    "state"
  ]
  item["tables"]["user"]["table"][7, 2] = np.nextafter(item["tables"]["user"]["table"][7, 2], 1)
  shutil.rmtree(os.path.join(work, "3"))
  d.manager.reload()
  d.manager.save(
    3, args=ocp.args.Composite(state=ocp.args.StandardSave(item), meta=ocp.args.JsonSave(meta))
  )
  r = _expect_newest_intact(saved, work)
  assert r.step == 2 and "tables/user/table" in r.skipped[0][1]


def test_truncated_data_file_is_skipped(saved, tmp_path):
  work = _copy(saved, tmp_path)
  path = max(_files(work, 3, data_only=True), key=os.path.getsize)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  assert _expect_newest_intact(saved, work).step == 2


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_short_or_missing_array_file_is_named_before_orbax_reads_it(
  saved, tmp_path, monkeypatch, damage
):
  work = _copy(saved, tmp_path)
  path = max(_files(work, 3, data_only=True), key=os.path.getsize)
  name, size = os.path.relpath(path, os.path.join(work, "3")), os.path.getsize(path)
  if damage == "truncated":
    with open(path, "r+b") as f:
      f.truncate(size // 2)
  else:
    os.remove(path)
  # The record of file sizes finds it: orbax is not asked for step 3's
  # arrays, so none of its reads is left in flight on a closed event loop.
  asked = []
  restore = ocp.CheckpointManager.restore

  def spy(self, step, args=None):
    asked.append((step, sorted(args.keys())))
    return restore(self, step, args=args)

  monkeypatch.setattr(ocp.CheckpointManager, "restore", spy)
  r = _expect_newest_intact(saved, work)
  why = {
    "truncated": f"{name} has {size // 2} bytes where {size} were written",
    "deleted": f"{name} is missing",
  }[damage]
  assert r.skipped[0][1] == f"its array files are not as written: {why}"
  assert (3, ["state"]) not in asked and (2, ["state"]) in asked, asked


def test_a_step_without_a_usable_file_record_is_read_and_checked_as_before(saved, tmp_path):
  # Written before records (or killed between the save and the record), or
  # a record that does not match its digest: orbax's read and the checksums
  # decide, as they do for every step.
  work = _copy(saved, tmp_path)
  os.remove(os.path.join(work, "3", checkpoint_files.NAME))
  record = os.path.join(work, "2", checkpoint_files.NAME)
  with open(record) as f:
    text = f.read()
  with open(record, "w") as f:
    f.write(text.replace('"files": {"', '"files": {"x', 1))
  for step in (3, 2):
    r = _restore(saved, work, step)
    assert r.step == step and not r.skipped
    _assert_same(_host(saved["trainer"], r.state), saved["refs"][step])


def test_read_only_restore_falls_back_and_renames_nothing(saved, tmp_path):
  work = _copy(saved, tmp_path)
  os.remove(os.path.join(work, "3", "meta", "metadata"))
  r = Checkpointer(work, saved["trainer"], read_only=True).restore_verified(
    saved["template"], saved["feeder"].train
  )
  assert r.step == 2 and [s for s, _ in r.skipped] == [3]
  assert sorted(os.listdir(work)) == ["1", "2", "3"]
  _assert_same(_host(saved["trainer"], r.state), saved["refs"][2])


@pytest.mark.parametrize(
  "victim",
  [
    "meta/metadata",
    "state/_METADATA",
    "state/manifest.ocdbt",
    "state",
    "data",
    "_CHECKPOINT_METADATA",
  ],
)
def test_deleted_file_is_skipped_or_not_needed(saved, tmp_path, victim):
  work = _copy(saved, tmp_path)
  path = (
    max(_files(work, 3, data_only=True), key=os.path.getsize)
    if victim == "data"
    else os.path.join(work, "3", victim)
  )
  shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
  _expect_newest_intact(saved, work)


def test_tampered_metadata_is_skipped(saved, tmp_path):
  work = _copy(saved, tmp_path)
  path = os.path.join(work, "3", "meta", "metadata")
  text = open(path).read()
  open(path, "w").write(
    text.replace('"data_position"', '"data_positiom"', 1)
    if '"data_position"' in text
    else text.replace('"exact": false', '"exact": true')
  )
  r = _expect_newest_intact(saved, work)
  assert r.step == 2 and "digest" in r.skipped[0][1]


def test_interrupted_save_leaves_no_step(saved, tmp_path):
  # What SIGKILL during a save leaves behind: a temporary directory.
  work = _copy(saved, tmp_path)
  shutil.copytree(os.path.join(work, "3"), os.path.join(work, "4.orbax-checkpoint-tmp"))
  r = _restore(saved, work)
  assert r.step == 3 and not r.skipped
  _assert_same(_host(saved["trainer"], r.state), saved["refs"][3])


def test_no_intact_step_is_a_typed_error_naming_each(saved, tmp_path):
  work = _copy(saved, tmp_path)
  for step in (1, 2, 3):
    os.remove(os.path.join(work, str(step), "meta", "metadata"))
  with pytest.raises(CheckpointCorruptError, match=r"step 3: .*step 2: .*step 1: "):
    _restore(saved, work)


def test_asking_for_a_corrupt_step_does_not_fall_back(saved, tmp_path):
  work = _copy(saved, tmp_path)
  os.remove(os.path.join(work, "3", "state", "_METADATA"))
  with pytest.raises(CheckpointCorruptError, match=r"step 3"):
    _restore(saved, work, step=3)
  assert _restore(saved, work, step=1).step == 1


def test_verify_command_names_the_corrupt_step(saved, tmp_path, capsys):
  work = _copy(saved, tmp_path)
  assert verify.main([work]) == 0
  assert "step 3: intact" in capsys.readouterr().out
  path = max(_files(work, 3, data_only=True), key=os.path.getsize)
  with open(path, "r+b") as f:
    f.truncate(10)
  assert verify.main([work]) == 1
  out = capsys.readouterr().out
  assert "step 3: NOT INTACT" in out and "step 2: intact" in out
  assert "newest intact step: 2 (--resume restores it, skipping 3)" in out
  assert verify.main([str(tmp_path / "nope")]) == 2


@pytest.mark.slow  # a child process of its own
def test_verify_command_runs_as_a_module(saved):
  out = subprocess.run(
    ["timeout", "-k", "5", "120", sys.executable, "-m", "pallas_emb.verify", saved["dir"]],
    cwd=REPO,
    capture_output=True,
    text=True,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "3 checkpoint steps" in out.stdout and "newest intact step: 3" in out.stdout


# -- a restore into another configuration ---------------------------------------


def test_restore_with_another_optimizer_is_refused(saved):
  tr, _, feeder = _trainer(optimizer=pe.SGD(0.1))
  with pytest.raises(CheckpointMismatchError, match=r"RowWiseAdagrad .*trainer's optimizer is SGD"):
    Checkpointer(saved["dir"], tr).restore(saved["template"], feeder.train)


def _logical(tr, state) -> dict:
  """Every logical table's table, slots and own step, as host arrays."""
  out = {}
  for name, ts in tr.emb.member_states(state.tables).items():
    out[f"{name}/table"] = tr.emb.logical_table(state.tables, name)
    out.update((f"{name}/{k}", v) for k, v in tr.emb.logical_slots(state.tables, name).items())
    out[f"{name}/step"] = int(ts.step)
  return out


def _flushed_at(saved, step):
  """The saved run's state at `step`, restored as saved (bit for bit) and
  flushed: a run that flushed at that step."""
  state, _ = saved["trainer"].flush(_restore(saved, saved["dir"], step).state)
  return state


@pytest.mark.slow
def test_restore_under_another_batch_size_equals_a_run_flushed_there(saved):
  """The async checkpoint of step 3 (step 2's gradient pending) restores
  into a trainer of twice the batch: the pending update is applied at
  restore, and the run continues exactly as the saved run flushed at step 3
  and continued with the bigger batches."""
  ref = _flushed_at(saved, 3)
  tr, model, feeder = _trainer(batch=2 * BATCH)
  template = tr.init(model.init(jax.random.key(1)), tr.emb.init(jax.random.key(2)), feeder.train(0))
  got = Checkpointer(saved["dir"], tr).restore(template, feeder.train, step=3)
  want = tr.init(ref.params, ref.tables, feeder.train(3))._replace(
    opt_state=ref.opt_state, step=ref.step
  )
  assert int(got.step) == 3 and not any(bool(u.pending) for u in got.pending.values())
  _assert_same(_logical(tr, got), _logical(tr, want))
  assert _logical(tr, want) != {}
  for t in (3, 4):
    got, m_got = tr.step(got, feeder.train(t), feeder.train(t + 1))
    want, m_want = tr.step(want, feeder.train(t), feeder.train(t + 1))
    assert float(m_got["loss"]) == float(m_want["loss"])
  _assert_same(_logical(tr, got), _logical(tr, want))


@pytest.mark.slow
def test_restore_into_the_sync_pipeline_on_other_devices_applies_the_pending_update(saved):
  """--noasync_emb on 6 devices with batches of 48 (the saved 64 do not
  split over 6: padded): the tables are the saved run's flushed at that
  step (to rounding: the per-row sums are added in another order)."""
  ref = _logical(saved["trainer"], _flushed_at(saved, 3))
  tr, model, feeder = _trainer(batch=48, devices=6, config=pe.TrainConfig(use_async_emb=False))
  template = tr.init(model.init(jax.random.key(1)), tr.emb.init(jax.random.key(2)), feeder.train(0))
  got = Checkpointer(saved["dir"], tr).restore(template, feeder.train, step=3)
  assert got.pending == {} and got.lookups == {}
  restored = _logical(tr, got)
  assert sorted(restored) == sorted(ref)
  for k, v in ref.items():
    np.testing.assert_allclose(restored[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
  # The pending update was applied: one more update than the saved state's.
  unflushed = _logical(saved["trainer"], _restore(saved, saved["dir"], 3).state)
  assert restored["user/step"] == unflushed["user/step"] + 1
  _, m = tr.step(got, feeder.train(3))
  assert np.isfinite(float(m["loss"]))


def test_restore_with_another_table_is_refused(saved):
  tr, _, feeder = _trainer(user_rows=501)
  with pytest.raises(CheckpointMismatchError, match=r"table 'user'"):
    Checkpointer(saved["dir"], tr).restore(saved["template"], feeder.train)


def test_restore_from_an_empty_directory_says_so(saved, tmp_path):
  with pytest.raises(CheckpointError, match="no checkpoint"):
    Checkpointer(str(tmp_path), saved["trainer"]).restore(saved["template"], saved["feeder"].train)


# -- directories that cannot be written ------------------------------------------


def _unwritable(tmp_path) -> str:
  if os.geteuid() != 0:
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o555)
    return str(path)
  return "/sys/fs"  # not even root may create files there


def test_unwritable_directory_fails_before_training(tmp_path, saved):
  with pytest.raises(CheckpointDirError, match="not writable"):
    Checkpointer(_unwritable(tmp_path), saved["trainer"])
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["pallas_emb", "--devices=8", f"--checkpoint_dir={_unwritable(tmp_path)}/ck"])
  try:
    with pytest.raises(CheckpointDirError, match="not writable"):
      main_lib.run()
  finally:
    flags.FLAGS.unparse_flags()


def test_failed_save_is_a_typed_error(saved, tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ck"), saved["trainer"])
  shutil.rmtree(tmp_path / "ck")
  (tmp_path / "ck").write_text("a file where the directory was")
  with pytest.raises(CheckpointDirError, match="writing checkpoint step 3"):
    ckpt.save(saved["state"], saved["shapes"])


_FAILING_SAVE = """
import os, shutil, sys, numpy as np
from pallas_emb.errors import CheckpointDirError
from pallas_emb.train.checkpoint_dir import CheckpointDir
d = CheckpointDir(sys.argv[1])
d.write(1, {"a": np.ones(4, np.float32)}, {})
shutil.rmtree(sys.argv[1])
open(sys.argv[1], "w").close()
try:
  d.write(2, {"a": np.ones(4, np.float32)}, {})
except CheckpointDirError as e:
  print("CheckpointDirError", e, flush=True)
"""


@pytest.mark.slow  # a child process of its own
def test_failed_save_does_not_hang_the_process(tmp_path):
  # orbax's asynchronous save left non-daemon threads waiting 20 minutes for
  # a directory that never came, and the process hung at exit.
  start = time.time()
  out = subprocess.run(
    ["timeout", "-k", "5", "120", sys.executable, "-c", _FAILING_SAVE, str(tmp_path / "ck")],
    cwd=REPO,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "CheckpointDirError" in out.stdout and "writing checkpoint step 2" in out.stdout
  assert time.time() - start < 100


_SAVER = """
import sys, time, numpy as np, jax
from pallas_emb.train.checkpoint_dir import CheckpointDir
d = CheckpointDir(sys.argv[1], max_to_keep=100)
for step in range(1, 1000):
  state = {"a": jax.numpy.full((2048, 2048), step, np.float32), "b": np.arange(step, step + 7)}
  print("saving", step, flush=True)
  d.write(step, state, {"step": step})
  print("saved", step, flush=True)
"""


@pytest.mark.slow  # a child process of its own
def test_sigkill_during_save_leaves_only_intact_steps(tmp_path):
  directory = str(tmp_path / "ck")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen(
    ["timeout", "-k", "5", "200", sys.executable, "-c", _SAVER, directory],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    text=True,
    start_new_session=True,
  )
  for line in proc.stdout:
    if line.startswith("saving 3"):
      break
  os.killpg(proc.pid, signal.SIGKILL)  # while it writes step 3 (16 MiB)
  proc.wait()
  d = CheckpointDir(directory, writable=False)
  steps = d.steps()
  assert steps and steps[0] in (2, 3)
  for step in steps:
    meta, arrays = d.verify(step)
    assert arrays == 2 and meta["step"] == step
    got = d.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(
          {"a": np.zeros((2048, 2048), np.float32), "b": np.zeros(7, np.int64)}
        )
      ),
    )["state"]
    np.testing.assert_array_equal(got["a"], np.full((2048, 2048), step, np.float32))
    np.testing.assert_array_equal(got["b"], np.arange(step, step + 7))


# -- misuse of the API -------------------------------------------------------------


def _small(mesh, name="t"):
  return pe.ShardedEmbedding(
    [pe.TableSpec(name, 50, 8, optimizer=pe.SGD(0.5))],
    [pe.FeatureSpec("f", name, "mean")],
    mesh,
    "x",
    "xla",
  )


def test_empty_batch_or_bag_is_refused_before_jax():
  emb = _small(make_mesh(8))
  tables = emb.init(jax.random.key(0))
  for shape in [(0, 2), (8, 0)]:
    ids = {"f": np.zeros(shape, np.int32)}
    for call in (
      lambda: emb.lookup(tables, ids),
      lambda: emb.plan(ids),
      lambda: async_emb.context_handles(emb, ids),
    ):
      with pytest.raises(EmptyInputError, match=rf"shape \({shape[0]}, {shape[1]}\)"):
        call()


def test_ids_on_other_devices_are_refused():
  emb = _small(make_mesh(8))
  tables = emb.init(jax.random.key(0))
  ids = np.arange(16, dtype=np.int32).reshape(16, 1)
  for device in (jax.devices()[0], jax.devices()[1]):  # outside; one of the mesh's
    with pytest.raises(PlacementError, match=r"ids of feature 'f' is on devices \[\d\]"):
      emb.lookup(tables, {"f": jax.device_put(ids, device)})
  # Committed to the mesh (any sharding) or on the host: fine.
  acts, _ = emb.lookup(tables, {"f": jax.device_put(ids, emb.sharding(rows=False))})
  want, _ = emb.lookup(tables, {"f": ids})
  np.testing.assert_array_equal(np.asarray(acts["f"]), np.asarray(want["f"]))


# Meshes that are not make_mesh(8): other devices, the same devices in
# another order, the same devices under another axis name.
OTHER_MESHES = {
  "devices": (
    lambda d: jax.sharding.Mesh(np.array(d[:8]), ("x",)),
    "x",
    "[0, 1, 2, 3, 4, 5, 6, 7]",
  ),
  "order": (
    lambda d: jax.sharding.Mesh(np.array(d[8:0:-1]), ("x",)),
    "x",
    "[8, 7, 6, 5, 4, 3, 2, 1]",
  ),
  "axis": (lambda d: jax.sharding.Mesh(np.array(d[1:9]), ("y",)), "y", "[1, 2, 3, 4, 5, 6, 7, 8]"),
}


@pytest.mark.parametrize("kind", OTHER_MESHES)
def test_tables_of_another_mesh_are_refused_and_untouched(kind):
  """Every entry refuses state of another mesh with MeshMismatchError naming
  both meshes, before any jitted call (JAX's own error is a ValueError)."""
  make, axis, devices = OTHER_MESHES[kind]
  emb = _small(make_mesh(8))
  other = dataclasses.replace(emb, mesh=make(jax.devices()), axis=axis)
  tables = other.init(jax.random.key(0))
  before = other.logical_table(tables, "t")
  ids = {"f": np.arange(16, dtype=np.int32).reshape(8, 2)}
  both = (
    rf"table 't'.* is on the mesh {{'{axis}': 8}} over devices \{devices[:-1]}\], but expected "
  )
  both += r"the mesh {'x': 8} over devices \[1, 2, 3, 4, 5, 6, 7, 8\]"
  with pytest.raises(MeshMismatchError, match=both):
    emb.lookup(tables, ids)
  with pytest.raises(MeshMismatchError, match=both):
    emb.logical_table(tables, "t")
  mine = emb.init(jax.random.key(0))
  _, res = emb.lookup(mine, ids)
  with pytest.raises(MeshMismatchError):
    emb.apply_gradients(tables, res, {"f": np.ones((8, 8), np.float32)})
  with pytest.raises(PlacementError, match="expected the mesh"):  # a MeshMismatchError
    emb.lookup(mine, {"f": jax.device_put(ids["f"], other.sharding())})
  np.testing.assert_array_equal(other.logical_table(tables, "t"), before)
  ctx = async_emb.context_handles(emb, ids)["t"]
  with pytest.raises(MeshMismatchError, match=both):
    async_emb.lookup_start(ctx, tables["t"].table, ids)
  state = pe.EmbOptState(tables["t"].slots, tables["t"].step)
  with pytest.raises(MeshMismatchError, match=both):
    async_emb.gradient_update_start(
      ctx, async_emb.empty_gradient_update(ctx), tables["t"].table, state
    )
  assert not ctx.in_flight
  # The async context of the other mesh refuses this mesh's table.
  other_ctx = async_emb.context_handles(other, ids)["t"]
  with pytest.raises(MeshMismatchError, match="expected the mesh"):
    async_emb.lookup_start(other_ctx, mine["t"].table, ids)
  tr = pe.make_trainer(
    emb,
    lambda p, a, b: (0.0, {}),
    optax.sgd(0.0),
    pe.TrainConfig(use_async_emb=False),
    {"ids": ids},
  )
  with pytest.raises(MeshMismatchError, match="the train state is on the mesh"):
    tr.step(pe.TrainState({}, (), tables, {}, {}, jnp.zeros((), jnp.int32)), {"ids": ids})


def _async(name, mesh):
  emb = _small(mesh, name)
  ids = {"f": (np.arange(16, dtype=np.int32).reshape(8, 2) * 3) % 50}
  ctx = async_emb.context_handles(emb, ids)[name]
  state = emb.init(jax.random.key(0))[name]
  lookup = async_emb.lookup_start(ctx, state.table, ids)
  update = async_emb.make_gradient_update(ctx, lookup, {"f": np.ones((8, 8), np.float32)})
  return emb, ctx, state, update


def test_update_of_another_table_is_refused_and_untouched():
  _, ctx_a, _, update_a = _async("a", make_mesh(8))
  emb_b, ctx_b, state_b, update_b = _async("b", make_mesh(8))
  _, _, _, update_other_mesh = _async("b", make_mesh(1))
  before = np.asarray(state_b.table)
  opt_state = pe.EmbOptState(state_b.slots, state_b.step)
  for update in (update_a, update_other_mesh):
    with pytest.raises(UpdateMismatchError, match=r"table 'b' .* was given the update of table"):
      async_emb.gradient_update_start(ctx_b, update, state_b.table, opt_state)
    assert not ctx_b.in_flight
  np.testing.assert_array_equal(np.asarray(state_b.table), before)
  # Its own update still applies.
  _, table, _, m = async_emb.gradient_update_start(ctx_b, update_b, state_b.table, opt_state)
  async_emb.gradient_update_done(ctx_b)
  assert bool(m["applied"]) and not np.array_equal(np.asarray(table), before)


def test_update_owner_is_static_through_jit_and_positional_updates_still_build():
  _, ctx, _, update = _async("a", make_mesh(8))
  assert update.owner == ctx.identity
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(update))
  assert ctx.identity not in [str(x) for x in jax.tree.leaves(update)]
  passed = jax.jit(lambda u: u)(update)
  assert passed.owner == ctx.identity
  bare = pe.AsyncEmbGradientUpdate(
    update.unique_tokens, update.grads, update.segment_ids, update.pending
  )
  assert bare.owner is None and bare.plan is None
  state = ctx.embedding.init(jax.random.key(0))["a"]
  with pytest.raises(
    pe.InputError, match="needs an AsyncEmbGradientUpdate from make_gradient_update"
  ):
    async_emb.gradient_update_start(ctx, bare, state.table, pe.EmbOptState(state.slots, state.step))


def test_trainer_refuses_ids_committed_to_one_device(saved):
  tr, feeder = saved["trainer"], saved["feeder"]
  batch = feeder.dataset.train_batch(0, BATCH)
  batch["ids"] = {k: jax.device_put(v, jax.devices()[0]) for k, v in batch["ids"].items()}
  with pytest.raises(PlacementError, match="jax.device_put"):
    tr.step(saved["template"], batch, feeder.train(1))


@pytest.mark.parametrize(
  "flag",
  [
    "--devices=-1",
    "--devices=0",
    "--steps=-5",
    "--steps=0",
    "--batch_size=0",
    "--emb_dim=0",
    "--log_every=0",
    "--checkpoint_every=-1",
    "--eval_every=-2",
    "--eval_batches=-1",
    "--seed=-3",
    "--heartbeat_timeout=0",
    "--num_processes=0",
    "--process_id=-1",
    "--emb_learning_rate=-0.1",
    "--emb_learning_rate=nan",
    "--dense_learning_rate=inf",
    "--resume",
    "--num_processes=2 --process_id=2",
  ],
)
def test_every_flag_range_is_checked_at_parse_time(flag):
  flags.FLAGS.unparse_flags()
  try:
    with pytest.raises(flags.IllegalFlagValueError, match=r"must be|needs"):
      flags.FLAGS(["pallas_emb", *flag.split()])
  finally:
    flags.FLAGS.unparse_flags()


# -- a lost peer (the live two-process case is in test_main.py) ----------------------

_PEER_DIED = """E1203 09:34:17.180946 coordination_service.cc:1549] Use error polling to propagate ...
F1203 09:34:17.181282 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
3
The tasks have crashed. Check the task logs for an earlier error.
"""  # noqa: E501  (a real log)
_LEADER_DIED = """F1203 09:35:32.716193 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died/restarted unexpectedly or this task is experiencing network issues.
"""  # noqa: E501  (a real log)


def test_supervisor_reads_which_process_was_lost(tmp_path):
  from pallas_emb.job import supervisor

  assert supervisor.lost_processes(_PEER_DIED) == ([1, 3], "it stopped sending heartbeats")
  assert supervisor.lost_processes(_LEADER_DIED)[0] == [0]
  assert supervisor.lost_processes("Traceback ...\nValueError: a bug\n") is None
  # A peer killed inside a collective: gloo aborts the worker, often before
  # the coordination service has declared the peer lost.
  broke = "F1204 pair.cc:555] Received data size doesn't match expected size. Is there ..."
  assert supervisor.lost_processes(broke, [1]) == ([1], "a collective with it broke off")
  assert supervisor.lost_processes(broke, [0, 2, 3]) == ([], "a collective with it broke off")
  for step in ("10", "20", "30.corrupt", "40.orbax-checkpoint-tmp"):
    os.makedirs(tmp_path / "ck" / step)
  argv = ["--num_processes", "4", "--process_id=2", f"--checkpoint_dir={tmp_path}/ck"]
  report = supervisor._report(argv, [1, 3], "it stopped sending heartbeats")
  assert report == (
    f"pallas_emb: lost processes 1, 3 of 4 (it stopped sending heartbeats); "
    f"process 2 stops too. Last good checkpoint: step 20 in {tmp_path}/ck; "
    "restart every process with --resume to continue from it."
  )
  assert "No checkpoint was written yet" in supervisor._report(argv[:2], [0], "x")
  assert supervisor.needed(argv) and not supervisor.needed(["--num_processes=1"])
