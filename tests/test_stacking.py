"""Table stacking: tables stored and updated as one equal the tables alone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh

import pallas_emb as pe
from pallas_emb import programs
from pallas_emb.stacking import plan as stacking
from pallas_emb.train.checkpoint import Checkpointer

D = 8


def _tables(opt, alone=False):
  # a, b, c stack (equal dim and optimizer); d has another dim and stays alone.
  return [pe.TableSpec("a", 37, D, optimizer=opt), pe.TableSpec("c", 20, D, optimizer=opt)] + (
    [pe.TableSpec("d", 30, 4, optimizer=opt)] if alone else []
  )


FEATURES = [pe.FeatureSpec("fa", "a"), pe.FeatureSpec("fc", "c"), pe.FeatureSpec("fa2", "a", None)]
FEATURE_D = pe.FeatureSpec("fd", "d")


def _emb(opt, n, stacking_mode, alone=False, kind="auto"):
  return pe.ShardedEmbedding(
    _tables(opt, alone),
    FEATURES + [FEATURE_D] * alone,
    make_mesh(n, kind=kind),
    "x",
    "xla",
    stacking=stacking_mode,
  )


def _dyadic(rng, shape):
  return (rng.integers(-8, 9, shape) / 8).astype(np.float32)


def _ids(rng, emb, batch=24):
  # Some padding (-1) and ids past every table's end (invalid).
  return {f.name: rng.integers(-1, 60, (batch, 2)).astype(np.int32) for f in emb.features}


def _run(emb, steps=2, nan_step=1, empty_step=None):
  """`steps` sync steps; c gets a non-finite gradient at `nan_step` and only
  padding at `empty_step`. Logs (acts, metrics, member steps) per step."""
  rng = np.random.default_rng(0)
  state = emb.init(jax.random.key(3))
  log = []
  for s in range(steps):
    ids = _ids(rng, emb)
    if s == empty_step:
      ids["fc"][:] = -1
    acts, res = emb.lookup(state, ids)
    grads = {k: _dyadic(rng, v.shape) for k, v in acts.items()}
    if s == nan_step:  # a non-finite gradient in c alone
      ids_c = ids["fc"]
      row = int(np.nonzero(((ids_c >= 0) & (ids_c < 20)).any(axis=1))[0][0])
      grads["fc"][row, 0] = np.nan
    state, metrics = emb.apply_gradients(state, res, grads)
    log.append(
      (
        {k: np.asarray(v) for k, v in acts.items()},
        jax.tree.map(np.asarray, {k: m._asdict() for k, m in metrics.items()}),
        {k: int(v.step) for k, v in emb.member_states(state).items()},
      )
    )
  return state, log


def _assert_same(e0, s0, e1, s1, names):
  m0, m1 = e0.member_states(s0), e1.member_states(s1)
  for t in names:
    np.testing.assert_array_equal(e0.logical_table(s0, t), e1.logical_table(s1, t))
    slots0, slots1 = e0.logical_slots(s0, t), e1.logical_slots(s1, t)
    assert slots0.keys() == slots1.keys()
    for k in slots0:
      np.testing.assert_array_equal(slots0[k], slots1[k])
    assert int(m0[t].step) == int(m1[t].step), t


def _assert_metrics_equal(m0, m1):
  assert m0.keys() == m1.keys()
  for t in m0:
    for k in m0[t]:
      np.testing.assert_array_equal(m0[t][k], m1[t][k], err_msg=f"{t}.{k}")


# Schedules make the update read each member's step (`reads_step`): a member
# left behind then needs its own step's learning rate.
DECAY = optax.exponential_decay(0.5, 1, 0.5)
OPTIMIZERS = [
  (pe.SGD(DECAY), 1),
  (pe.Adagrad(0.25), 6),
  (pe.RowWiseAdagrad(0.1, half_life_steps=3.0, lazy_decay=True), 8),
  (pe.LazyAdam(optax.exponential_decay(0.05, 1, 0.8)), 8),
  (pe.FTRL(DECAY, l1=0.01, l2=0.01), 6),
]

# The quick loop's subset (conftest): LazyAdam (a decaying schedule, three
# slots, one per-row step).
QUICK = {"test_stacked_equals_unstacked_bit_for_bit": lambda p: isinstance(p["opt"], pe.LazyAdam)}


@pytest.mark.parametrize("opt,n", OPTIMIZERS, ids=lambda x: getattr(type(x), "__name__", str(x)))
def test_stacked_equals_unstacked_bit_for_bit(opt, n):
  """Step by step, while c is skipped (a non-finite gradient, step 1) and
  gets no ids (step 2): acts, metrics and each member's step agree, and
  so do the tables after c is applied again (step 3)."""
  off, auto = _emb(opt, n, "off"), _emb(opt, n, "auto")
  assert off.table_names == ("a", "c")
  assert auto.table_names == ("a+c",)
  s0, log0 = _run(off, steps=4, empty_step=2)
  s1, log1 = _run(auto, steps=4, empty_step=2)
  _assert_same(off, s0, auto, s1, "ac")
  for (a0, m0, st0), (a1, m1, st1) in zip(log0, log1):
    assert a0.keys() == a1.keys()
    for k in a0:
      np.testing.assert_array_equal(a0[k], a1[k])
    _assert_metrics_equal(m0, m1)
    assert st0 == st1
  # c was skipped at step 1 (its neighbour applied), had nothing to apply at
  # step 2, and kept its own step count.
  skipped, empty = log1[1][1], log1[2][1]
  assert not skipped["c"]["applied"] and not np.isfinite(skipped["c"]["grad_norm"])
  assert skipped["a"]["applied"] and empty["a"]["applied"]
  assert not empty["c"]["applied"] and empty["c"]["unique_ids"] == 0
  assert [st["c"] for _, _, st in log1] == [1, 1, 1, 2]
  assert [st["a"] for _, _, st in log1] == [1, 2, 3, 4]
  assert all(log1[0][1][t]["invalid_ids"] > 0 and log1[3][1][t]["unique_ids"] > 0 for t in "ac")


def test_offsets_rotate_row_zero_over_the_shards():
  tables = [pe.TableSpec(n, r, D) for n, r in (("a", 10), ("b", 7), ("c", 16), ("d", 3))]
  starts = stacking.offsets(tables, 4)
  assert starts == (0, 13, 22, 43)
  assert [s % 4 for s in starts] == [0, 1, 2, 3]
  assert all(s >= e for s, e in zip(starts[1:], np.add(starts, [10, 7, 16, 3])))
  ranged = [pe.TableSpec(t.name, t.num_rows, D, layout="range") for t in tables]
  assert stacking.offsets(ranged, 4) == (0, 10, 17, 33)


def test_stacking_by_hand_and_its_errors():
  tables = _tables(pe.SGD(0.5), alone=True)
  mesh, feats = make_mesh(2), FEATURES + [FEATURE_D]
  emb = pe.ShardedEmbedding(tables, feats, mesh, "x", "xla", stacking={"ac": ["c", "a"]})
  assert emb.table_names == ("ac", "d")
  assert [t.name for t in emb.group_of("c").tables] == ["a", "c"]
  assert [f.name for f in emb.features_of("ac")] == ["fa", "fa2", "fc"]
  # Physical names for the stored tables, logical names for one table.
  assert emb.logical_spec("a").name == "a" and emb.table_spec("ac").name == "ac"
  assert [f.name for f in emb.logical_features("a")] == ["fa", "fa2"]
  for method in (emb.table_spec, emb.layout, emb.features_of):
    with pytest.raises(pe.InputError, match="'a' is a logical table stored in the stacked table"):
      method("a")
  with pytest.raises(pe.InputError, match="unknown table 'x'"):
    emb.logical_spec("x")
  for bad, words in (
    ({"g": ["a", "d"]}, "cannot share"),
    ({"g": ["a", "x"]}, "'x'"),
    ({"g": ["a"], "h": ["a", "c"]}, "two groups"),
    ("sometimes", "stacking must"),
    ({"a": ["c", "a"]}, "table's name"),
  ):
    with pytest.raises(pe.SpecError, match=words):
      pe.ShardedEmbedding(tables, feats, mesh, "x", "xla", stacking=bad)


def test_init_and_member_states_round_trip():
  emb = _emb(pe.Adagrad(0.1), 6, "auto", alone=True)
  assert emb.table_names == ("a+c", "d")
  off = emb.unstacked()
  state = emb.init(jax.random.key(1))
  alone = off.init(jax.random.key(1))
  _assert_same(emb, state, off, alone, "acd")
  back = emb.from_member_states(off.member_states(alone))
  _assert_same(emb, back, off, alone, "acd")


def _trainer(emb, use_async, batch):
  w = {
    f.name: jnp.asarray((np.arange(emb.logical_spec(f.table).dim) % 5 - 2) / 4, jnp.float32)
    for f in emb.features
  }

  def loss_fn(params, acts, batch):
    total = sum(jnp.sum(acts[k] * w[k]) for k in acts) * params["s"]
    # NaN in c's gradient alone where batch["nan_c"] is (the dense gradient,
    # of params["s"], stays finite).
    return total + jnp.sum(acts["fc"]) * batch["nan_c"], {}

  tr = pe.make_trainer(emb, loss_fn, optax.sgd(0.0), pe.TrainConfig(use_async_emb=use_async), batch)
  return tr, {"s": jnp.ones((), jnp.float32)}


def _trainer_batches(rng, emb):
  """Five batches: c gets only padding in batch 1 and a non-finite gradient
  in batch 2."""
  batches = [{"ids": _ids(rng, emb), "nan_c": np.float32(0.0)} for _ in range(5)]
  batches[1]["ids"]["fc"][:] = -1
  batches[2]["nan_c"] = np.float32(np.nan)
  return batches


@pytest.mark.slow
@pytest.mark.parametrize(
  "use_async,kind",
  [(False, "auto"), (True, "auto"), (True, "explicit")],
  ids=["sync", "async", "async-explicit"],
)
def test_trainer_stacked_equals_unstacked_and_checkpoints_cross_over(use_async, kind, tmp_path):
  """Both pipelines give the same tables, metrics and member steps stacked
  or not, while c gets no ids or a non-finite gradient, with a learning-rate
  schedule; a checkpoint of either restores into the other (async: the
  pending update too) and the runs continue identically."""
  rng = np.random.default_rng(5)
  runs = {}
  opt = pe.RowWiseAdagrad(optax.exponential_decay(0.1, 1, 0.7), half_life_steps=None)
  for mode in ("off", "auto"):
    emb = _emb(opt, 4, mode, kind=kind)

    def put(b, emb=emb):
      return {**b, "ids": {k: jax.device_put(v, emb.sharding()) for k, v in b["ids"].items()}}

    batches = runs["off"]["batches"] if runs else _trainer_batches(rng, emb)
    tr, params = _trainer(emb, use_async, put(batches[0]))
    template = tr.init(params, emb.init(jax.random.key(0)), put(batches[0]))
    state = tr.init(params, emb.init(jax.random.key(0)), put(batches[0]))
    log = []
    for i in range(3):
      state, m = tr.step(state, put(batches[i]), put(batches[i + 1]))
      log.append(jax.tree.map(np.asarray, m["emb"]))
    ckpt = Checkpointer(str(tmp_path / mode), tr)
    ckpt.save(state, {k: v.shape for k, v in batches[0]["ids"].items()})
    runs[mode] = dict(
      emb=emb, tr=tr, state=state, log=log, put=put, batches=batches, template=template, ckpt=ckpt
    )
  off, auto = runs["off"], runs["auto"]
  _assert_same(off["emb"], off["state"].tables, auto["emb"], auto["state"].tables, "ac")
  for m0, m1 in zip(off["log"], auto["log"]):
    _assert_metrics_equal(m0, m1)
  # c applied nothing at the step of batch 1 (sync: step 1; async: step 2).
  assert not auto["log"][1 + use_async]["c"]["applied"]
  # Each trainer restores the other's checkpoint and takes the fourth step
  # (async: it applies batch 2's non-finite gradient and skips c).
  for mine, other in ((off, auto), (auto, off)):
    ckpt = Checkpointer(other["ckpt"].directory, mine["tr"])
    restored = ckpt.restore(mine["template"], lambda i: mine["put"](mine["batches"][i]))
    _assert_same(mine["emb"], restored.tables, other["emb"], other["state"].tables, "ac")
    mine["next"] = mine["tr"].step(
      restored, mine["put"](mine["batches"][3]), mine["put"](mine["batches"][4])
    )
  _assert_same(off["emb"], off["next"][0].tables, auto["emb"], auto["next"][0].tables, "ac")
  last = jax.tree.map(np.asarray, auto["next"][1]["emb"])
  _assert_metrics_equal(jax.tree.map(np.asarray, off["next"][1]["emb"]), last)
  assert bool(last["c"]["skipped"]) == use_async and bool(last["a"]["applied"])


@pytest.mark.parametrize("n", [6])
def test_replicated_equals_sharded(n):
  """A replicated table (whole on every device, no all_to_all) trains
  bit-identically to the sharded one, metrics included (but the capacity
  diagnostics, which describe another routing)."""
  opt = pe.LazyAdam(0.05)
  runs = []
  for kw in ({}, {"replicate_below": 30}):
    emb = pe.ShardedEmbedding(
      _tables(opt), FEATURES, make_mesh(n), "x", "xla", stacking="off", **kw
    )
    runs.append((emb,) + _run(emb))
  (e0, s0, log0), (e1, s1, log1) = runs
  assert e1.layout("c").num_shards == 1 and e1.layout("a").num_shards == n
  assert s1["c"].table.sharding.is_fully_replicated
  _assert_same(e0, s0, e1, s1, "ac")
  for (a0, m0, _), (a1, m1, _) in zip(log0, log1):
    for k in a0:
      np.testing.assert_array_equal(a0[k], a1[k])
    for t in m0:
      for k in (
        "unique_ids",
        "invalid_ids",
        "overflow_ids",
        "grad_norm",
        "applied",
        "max_unique_per_shard",
      ):
        np.testing.assert_array_equal(m0[t][k], m1[t][k], err_msg=f"{t}.{k}")
  assert not log1[-1][1]["c"]["applied"] and log1[-1][1]["a"]["applied"]
  # Stored alone and sharded for checkpoints; back to replicated.
  back = e1.from_member_states(e1.member_states(s1))
  assert back["c"].table.sharding.is_fully_replicated
  _assert_same(e1, back, e0, s0, "ac")
  # The replicated table's lookup and update exchange nothing all-to-all.
  ids = (jnp.asarray(_ids(np.random.default_rng(1), e1)["fc"]),)
  for emb, state, count in ((e0, s0, True), (e1, s1, False)):
    t = emb.sharded_table("c", ids[0].shape[0] // n * ids[0].shape[1])
    text = programs.lookup.lower(t, state["c"].table, ids).as_text()
    res = programs.plan(t, ids)
    text += programs.apply_gradients.lower(
      t, state["c"], res, (jnp.zeros((24, D)),), True
    ).as_text()
    assert ("all_to_all" in text) == count


def test_interpret_kernel_agrees_with_xla_when_a_member_is_skipped():
  """The Pallas kernel (interpret mode) gets the compacted rows of the
  applied members, like the XLA path: both give the same tables; after the
  skip the members are at different steps, and with a schedule the kernel
  runs once per step (a loop)."""
  opt = pe.RowWiseAdagrad(DECAY, half_life_steps=None)
  tables = [pe.TableSpec("a", 12, D, optimizer=opt), pe.TableSpec("c", 9, D, optimizer=opt)]
  feats = [pe.FeatureSpec("fa", "a"), pe.FeatureSpec("fc", "c")]
  out = []
  for backend in ("xla", "interpret"):
    emb = pe.ShardedEmbedding(tables, feats, make_mesh(1), "x", backend)
    state = emb.init(jax.random.key(0))
    ids = {
      "fa": np.array([[0], [5], [11], [-1]], np.int32),
      "fc": np.array([[2], [8], [3], [20]], np.int32),
    }
    for step in range(2):
      acts, res = emb.lookup(state, ids)
      grads = {k: _dyadic(np.random.default_rng(2), v.shape) for k, v in acts.items()}
      if step == 0:
        grads["fc"][1, 0] = np.inf
      state, m = emb.apply_gradients(state, res, grads)
      assert bool(m["a"].applied) and bool(m["c"].applied) == (step == 1)
    np.testing.assert_array_equal(state["a+c"].step, [2, 1])
    out.append([emb.logical_table(state, t) for t in "ac"])
  for x, y in zip(*out):
    np.testing.assert_array_equal(x, y)
