"""Rows whose width neither divides 128 nor is a multiple of it, stored padded
(pallas_emb.packing): the padded widths and their waste, the stored shapes,
the optimizer math on logical rows (a row-wise mean over `dim` columns, not
the padded width), the block kernels in TPU interpret mode bit for bit
against the XLA path, pad words that stay zero, and host copies,
checkpoint-style resharding and a sharded step that never show the padding."""

import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from kernel_cases import (
  STEP,
  assert_kernels_equal_xla,
  bits,
  random_state,
  run_update,
  sweep_ids,
)

import pallas_emb as pe
from pallas_emb import kernels, packing
from pallas_emb import state as state_lib
from sharding.layout import RowLayout

OPTIMIZERS = [
  pe.RowWiseAdagrad(0.1, half_life_steps=3, lazy_decay=True, weight_decay=0.01),
  pe.LazyAdam(0.05),
]
OPT_IDS = [type(o).__name__ for o in OPTIMIZERS]
SHAPES = [(jnp.float32, 96), (jnp.bfloat16, 96), (jnp.float32, 192), (jnp.bfloat16, 192)]
SHAPE_IDS = ["f32-96", "bf16-96", "f32-192", "bf16-192"]

# The quick loop's subset (conftest): f32 D=96, both optimizers.
QUICK = {
  "test_padded_kernels_equal_xla": lambda p: p["shape"] == SHAPES[0],
}


def test_padded_widths_and_their_waste():
  want = {1: 1, 3: 4, 8: 8, 24: 32, 48: 64, 96: 128, 128: 128, 160: 256, 192: 256, 320: 384}
  assert {w: packing.padded_width(w) for w in want} == want
  assert packing.padding_waste(96) == packing.padding_waste(192) == 0.25
  assert packing.padding_waste(64) == packing.padding_waste(256) == 0.0
  with pytest.raises(pe.InputError, match="at least 1 word"):
    packing.padded_width(0)


def test_stored_shapes_are_lane_dense_for_every_width():
  f32, bf16 = jnp.float32, jnp.bfloat16
  assert packing.table_shape(256, 96, f32) == (256, 128)
  assert packing.table_shape(256, 96, bf16) == (128, 128)  # 48 words -> 64, 2 to a row
  assert packing.table_shape(256, 192, f32) == (256, 256)
  assert packing.table_shape(256, 192, bf16) == (256, 128)  # 96 words -> 128
  assert packing.table_shape(256, 48, f32) == (128, 128)
  m = pe.LazyAdam().slot_specs()["m"]
  assert m.shape_for(256, 96) == (256, 128) and m.shape_for(256, 192) == (256, 256)
  assert m.width_for(96) == 96 and m.stored_width(96) == 128


@pytest.mark.parametrize("dtype,dim", SHAPES, ids=SHAPE_IDS)
def test_host_conversions_drop_and_restore_the_padding(dtype, dim):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, dim)).astype(np.float32)
  stored = packing.table_stored(packing.to_storage(x, dtype), dim, dtype)
  rows = packing.table_rows(stored, dim, dtype)
  assert rows.shape == (64, packing.storage_width(dim, dtype))
  np.testing.assert_array_equal(rows[:, packing.row_words(dim, dtype) :], 0)
  back = packing.from_storage(rows, dtype, dim)
  np.testing.assert_array_equal(back, np.asarray(x.astype(dtype)))
  m = pe.LazyAdam().slot_specs()["m"]
  slot = m.as_stored(x, dim)
  np.testing.assert_array_equal(m.values(slot, dim), x)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_xla_path_on_padded_state_is_the_logical_update(opt):
  # The math sees rows of `dim` columns: RowWiseAdagrad's mean square is
  # over 96 columns, not 128.
  dtype, dim = jnp.float32, 96
  rng = np.random.default_rng(1)
  table, slots = random_state(opt, dtype, dim, rng)
  rows = sweep_ids(rng)
  grads = rng.normal(size=(rows.size, dim)).astype(np.float32)
  scalars = opt.scalars(jnp.int32(STEP))
  got_table, got_slots = run_update("xla", opt, dtype, table, slots, rows, grads, scalars, True)
  specs = opt.slot_specs()
  live = rows[(rows >= 0) & (rows < table.shape[0])]
  logical = {k: np.asarray(specs[k].values(v, dim))[live] for k, v in slots.items()}
  want_rows, want_slots = opt.update_rows(
    jnp.asarray(table[live, :dim]), logical, jnp.asarray(grads[: live.size]), scalars
  )
  # To an ulp or two: XLA fuses the jitted path's arithmetic differently
  # from the eager reference; math over 128 columns would be off by a
  # quarter.
  close = lambda a, b, msg="": np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8, err_msg=msg)
  close(np.asarray(got_table)[live, :dim], np.asarray(want_rows))
  np.testing.assert_array_equal(np.asarray(got_table)[:, dim:], 0)
  for k in slots:
    got = np.asarray(specs[k].values(got_slots[k], dim))[live]
    close(got, np.asarray(want_slots[k]), k)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_padded_kernels_equal_xla(opt, shape):
  dtype, dim = shape
  table, slots, _, got = assert_kernels_equal_xla(opt, dtype, dim)
  words = packing.row_words(dim, dtype)
  np.testing.assert_array_equal(packing.table_rows(np.asarray(got[0]), dim, dtype)[:, words:], 0)
  assert kernels.uses_kernel("pallas", jnp.asarray(table), slots)


def test_stochastic_rounding_of_padded_bf16_rows_equals_xla():
  # The noise is keyed by (row, column) of the logical row: padding must
  # not shift it.
  opt, dtype, dim = pe.RowWiseAdagrad(0.1), jnp.bfloat16, 96
  _, _, rows, got = assert_kernels_equal_xla(opt, dtype, dim, seed=3, rounding=True)
  rng = np.random.default_rng(3)
  table, slots = random_state(opt, dtype, dim, rng)
  grads = np.random.default_rng(3).normal(size=(rows.size, dim)).astype(np.float32)
  nearest = run_update("xla", opt, dtype, table, slots, rows, grads, opt.scalars(STEP), True)
  assert not np.array_equal(bits(got[0]), bits(nearest[0]))


def test_host_state_reshards_and_round_trips_without_padding():
  spec = pe.TableSpec("t", 64, 96, optimizer=pe.LazyAdam(), dtype=jnp.bfloat16)
  rng = np.random.default_rng(6)
  logical = rng.normal(size=(64, 96)).astype(np.float32)
  m = rng.normal(size=(64, 96)).astype(np.float32)
  a, b = RowLayout(64, 8), RowLayout(64, 4)
  specs = spec.optimizer.slot_specs()
  stored = packing.table_stored(
    a.to_physical(packing.to_storage(logical, spec.dtype)), 96, spec.dtype
  )
  moved = state_lib.reshard_table(spec, a, b, stored)
  got = packing.from_storage(
    b.to_logical(packing.table_rows(moved, 96, spec.dtype)), spec.dtype, 96
  )
  np.testing.assert_array_equal(got, logical.astype(jnp.bfloat16))
  slots = {
    "m": specs["m"].as_stored(a.to_physical(m), 96),
    "v": specs["v"].as_stored(a.to_physical(m), 96),
  }
  slots["count"] = np.zeros(specs["count"].shape_for(64, 96, 8), np.int32)
  moved = state_lib.reshard_slots(spec, a, b, slots)
  assert moved["m"].shape == (64, 128)
  np.testing.assert_array_equal(b.to_logical(specs["m"].values(moved["m"], 96)), m)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_a_sharded_step_on_a_padded_table(backend, mesh_kind):
  # 8 shards of 128 rows of 96 floats (whole groups of the per-row scalar
  # slot: the update kernel runs): the padding is invisible to the user
  # (logical tables of 96 columns), and both backends agree.
  table = pe.TableSpec("t", 1024, 96, optimizer=pe.RowWiseAdagrad(0.1))
  feats = [pe.FeatureSpec("bag", "t", "sum")]
  results = {}
  for b in ("xla", backend):
    emb = pe.ShardedEmbedding([table], feats, make_mesh(8, kind=mesh_kind), "x", b)
    state = emb.init(jax.random.key(3))
    assert state["t"].table.shape == (1024, 128)
    before = emb.logical_table(state, "t")
    rng = np.random.default_rng(0)
    ids = {"bag": rng.integers(0, 1024, (16, 3)).astype(np.int32)}
    acts, res = emb.lookup(state, ids)
    assert acts["bag"].shape == (16, 96)
    grads = {"bag": rng.normal(size=(16, 96)).astype(np.float32)}
    state, metrics = emb.apply_gradients(state, res, grads)
    assert bool(metrics["t"].applied)
    results[b] = (emb.logical_table(state, "t"), emb.logical_slots(state, "t")["acc"])
  logical, acc = results[backend]
  assert logical.shape == (1024, 96) and acc.shape == (1024, 1)
  np.testing.assert_array_equal(logical, results["xla"][0])
  np.testing.assert_array_equal(acc, results["xla"][1])
  moved = np.any(logical != before, axis=1)
  np.testing.assert_array_equal(np.flatnonzero(moved), np.unique(ids["bag"]))


def test_rows_routed_padded_give_the_unpadded_step(monkeypatch):
  # On a TPU mesh a 192-wide table routes its rows and gradients 256 wide
  # (`ShardedTable.route_width`); forced here on CPU, the lookup and the
  # update are those of the unpadded route, bit for bit.
  from pallas_emb.sharded_table import ShardedTable  # noqa: PLC0415

  spec = pe.TableSpec("t", 64, 192, optimizer=pe.LazyAdam(0.05))
  feats = [pe.FeatureSpec("bag", "t", "mean"), pe.FeatureSpec("seq", "t", None)]
  rng = np.random.default_rng(0)
  ids = {"bag": rng.integers(-1, 64, (16, 3)), "seq": rng.integers(0, 64, (16, 2))}
  ids = {k: v.astype(np.int32) for k, v in ids.items()}
  grads = {"bag": rng.normal(size=(16, 192)), "seq": rng.normal(size=(16, 2, 192))}
  grads = {k: v.astype(np.float32) for k, v in grads.items()}

  def run():
    emb = pe.ShardedEmbedding([spec], feats, make_mesh(4), "x", "xla")
    state = emb.init(jax.random.key(0))
    acts, res = emb.lookup(state, ids)
    state, _ = emb.apply_gradients(state, res, grads)
    return {k: np.asarray(v) for k, v in acts.items()}, emb.logical_table(state, "t")

  want = run()
  monkeypatch.setattr(ShardedTable, "route_width", lambda t, w: 256 if w == 192 else w)
  jax.clear_caches()  # the programs are cached by their (equal) ShardedTable
  got = run()
  jax.clear_caches()
  for k in ids:
    assert got[0][k].shape[-1] == 192
    np.testing.assert_array_equal(got[0][k], want[0][k], k)
  np.testing.assert_array_equal(got[1], want[1])


DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _fixture(tmp_path, kind):
  """A copy of a checkpoint written before padded storage
  (`data/make_unpadded_checkpoint.py`) and what its tables held."""
  src = os.path.join(DATA, "unpadded_checkpoint", kind)
  shutil.copytree(src, tmp_path / kind)
  return str(tmp_path / kind), np.load(os.path.join(src, "expected.npz"))


def _assert_tables(emb, tables, expected, names):
  for name in names:
    np.testing.assert_array_equal(
      emb.logical_table(tables, name).astype(np.float32), expected[f"{name}/table"], name
    )
    for k, v in emb.logical_slots(tables, name).items():
      np.testing.assert_array_equal(v, expected[f"{name}/{k}"], f"{name}/{k}")


def test_a_trainer_checkpoint_from_before_padding_restores(tmp_path):
  sys.path.insert(0, DATA)
  import make_unpadded_checkpoint as fixture  # noqa: PLC0415

  from pallas_emb.train.checkpoint import Checkpointer  # noqa: PLC0415

  path, expected = _fixture(tmp_path, "trainer")
  tr, params = fixture.trainer(make_mesh(1))
  template = tr.init(params, tr.emb.init(jax.random.key(0)), {"ids": fixture.batch(0)})
  state = Checkpointer(path, tr).restore(template, lambda i: {"ids": fixture.batch(i)})
  assert state.tables["wide"].table.shape == (64, 128)  # 96 floats padded
  _assert_tables(tr.emb, state.tables, expected, ("wide", "half"))
  # It trains on, and its next checkpoint is written padded.
  state, _ = tr.step(state, {"ids": fixture.batch(2)}, {"ids": fixture.batch(3)})
  assert Checkpointer(path, tr).save(state, {"w": (8, 3), "h": (8, 2)}) == 3
  assert Checkpointer(path, tr).metadata(3)["padded_rows"]


@pytest.mark.parametrize("devices", [1, 2])
def test_a_vocab_checkpoint_from_before_padding_restores(tmp_path, devices):
  sys.path.insert(0, DATA)
  import make_unpadded_checkpoint as fixture  # noqa: PLC0415

  from pallas_emb.train.checkpoint_vocab import VocabCheckpointer  # noqa: PLC0415

  path, expected = _fixture(tmp_path, "vocab")
  emb = fixture.vocab_emb(make_mesh(devices))
  tables, vocabs, _ = VocabCheckpointer(path, emb).restore(
    emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  )
  assert tables["dyn"].table.shape == (64, 128)
  np.testing.assert_array_equal(
    np.sort(emb.resident_ids(vocabs, "dyn")), np.sort(expected["dyn/resident"])
  )
  if devices == 1:  # onto 2 shards the dynamic rows move with their ids
    _assert_tables(emb, tables, expected, ("dyn", "half"))
  else:
    _assert_tables(emb, tables, expected, ("half",))
