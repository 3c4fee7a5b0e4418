"""Dynamic tables through the `Trainer`: each pipeline equals the low-level
calls (`emb.admit`, `lookup`, `apply_gradients`) step for step, in the
order `train.vocab_step` states."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh

import pallas_emb as pe
from pallas_emb.errors import InputError
from pallas_emb.vocabulary import DynamicVocabulary

B, L, D, ROWS = 16, 3, 8, 64
PARAMS = {"scale": jnp.float32(1.0), "bias": jnp.float32(0.0)}


def _emb(num_devices):
  vocab = DynamicVocabulary(admit_after=2, probe_limit=4)
  table = pe.TableSpec(
    "t", ROWS, D, vocabulary=vocab, optimizer=pe.RowWiseAdagrad(0.2, half_life_steps=None)
  )
  static = pe.TableSpec("s", 32, D, optimizer=pe.SGD(0.1))
  feats = [pe.FeatureSpec("f", "t", "sum"), pe.FeatureSpec("g", "s", "sum")]
  return pe.ShardedEmbedding([table, static], feats, make_mesh(num_devices), "x", "xla")


def _batches(n, seed=0):
  """Raw ids over 40 distinct values (more than fit at once with admit_after=2
  and evictions), 10% padding; a static feature beside them."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    raw = (rng.integers(0, 40, (B, L)) * 7919 + 2**40).astype(np.int64)
    raw[rng.random((B, L)) < 0.1] = -1
    out.append(
      {
        "ids": {"f": raw, "g": rng.integers(0, 32, (B, 1)).astype(np.int32)},
        "w": (rng.integers(-8, 9, (B, D)) / 8).astype(np.float32),
        "y": (rng.random(B) < 0.5).astype(np.float32),
      }
    )
  return out


def _loss_fn(params, acts, batch):
  emb = acts["f"] + acts["g"]
  logit = jnp.sum(emb * batch["w"], axis=1) * params["scale"] + params["bias"]
  return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, batch["y"])), {}


def _trainer_run(emb, config, batches):
  tr = pe.make_trainer(emb, _loss_fn, optax.sgd(0.1), config, batches[0])
  vocabs = emb.init_vocabularies(jax.random.key(1))
  state = tr.init(PARAMS, emb.init(jax.random.key(0)), batches[0], vocabs)
  metrics = []
  for t in range(len(batches)):
    state, m = tr.step(state, batches[t], batches[min(t + 1, len(batches) - 1)])
    metrics.append(jax.device_get(m["vocab"]["t"]))
  state, _ = tr.flush(state)
  return state, tr, metrics


def _low_level(emb, batches, pipeline):
  """The same training with the low-level calls. sync admits batch t in step
  t; exact and async admit batch t+1 at the end of step t (init admits
  batch 0), async applying step t's gradient in step t+1."""
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  params, opt = PARAMS, optax.sgd(0.1)
  opt_state, pending, metrics = opt.init(params), None, []

  # Jitted, as the Trainer's dense step is: op by op, XLA:CPU's eager
  # dispatch on the mesh's 8 devices aborted a test worker about once in
  # five runs of this module and two others (cause not found).
  @jax.jit
  def dense(params, opt_state, acts, batch):
    (_, _), (g_p, g_a) = jax.value_and_grad(_loss_fn, argnums=(0, 1), has_aux=True)(
      params, acts, batch
    )
    upd, opt_state = opt.update(g_p, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, g_a

  def admit(tables, vocabs, batch):
    rows, tables, vocabs, vm = emb.admit(tables, vocabs, {"f": batch["ids"]["f"]})
    return {**batch["ids"], **rows}, tables, vocabs, vm

  if pipeline != "sync":
    ids, tables, vocabs, _ = admit(tables, vocabs, batches[0])
    acts, res = emb.lookup(tables, ids)
  for t, batch in enumerate(batches):
    if pipeline == "sync":
      ids, tables, vocabs, vm = admit(tables, vocabs, batch)
      acts, res = emb.lookup(tables, ids)
    if pending is not None:
      tables, _ = emb.apply_gradients(tables, *pending)
    params, opt_state, g_a = dense(params, opt_state, acts, batch)
    if pipeline == "async":
      pending = (res, g_a)
    else:
      tables, _ = emb.apply_gradients(tables, res, g_a)
    if pipeline != "sync":
      nxt = batches[min(t + 1, len(batches) - 1)]
      ids, tables, vocabs, vm = admit(tables, vocabs, nxt)
      acts, res = emb.lookup(tables, ids)
    metrics.append(jax.device_get(vm["t"]._asdict()))
  if pending is not None:
    tables, _ = emb.apply_gradients(tables, *pending)
  return tables, vocabs, params, metrics


CONFIGS = {
  "sync": pe.TrainConfig(use_async_emb=False),
  "exact": pe.TrainConfig(use_async_emb=True, exact=True),
  "async": pe.TrainConfig(use_async_emb=True),
}


@pytest.mark.parametrize("pipeline", sorted(CONFIGS))
def test_trainer_equals_the_low_level_calls(pipeline):
  emb, batches = _emb(8), _batches(6)
  state, _, metrics = _trainer_run(emb, CONFIGS[pipeline], batches)
  tables, vocabs, params, want = _low_level(emb, batches, pipeline)
  for name in ("t", "s"):
    np.testing.assert_array_equal(
      emb.logical_table(state.tables, name), emb.logical_table(tables, name)
    )
  np.testing.assert_array_equal(
    emb.logical_slots(state.tables, "t")["acc"], emb.logical_slots(tables, "t")["acc"]
  )
  for got, ref in zip(emb.resident_rows(state.vocabs, "t"), emb.resident_rows(vocabs, "t")):
    np.testing.assert_array_equal(got, ref)
  assert jax.device_get(state.params) == jax.device_get(params)
  assert metrics == want
  assert sum(int(m["inserts"]) for m in want) > 0 and sum(int(m["not_admitted"]) for m in want) > 0


def test_evaluate_reads_the_maps_without_changing_them():
  emb, batches = _emb(4), _batches(3)
  state, tr, _ = _trainer_run(emb, CONFIGS["sync"], batches)
  before = [np.asarray(x).copy() for x in state.vocabs["t"].map]
  loss, _ = tr.evaluate(state, batches[1])
  rows, _ = emb.read_rows(state.vocabs, {"f": batches[1]["ids"]["f"]})
  acts, _ = emb.lookup(state.tables, {**batches[1]["ids"], **rows})
  with jax.sharding.set_mesh(emb.mesh):
    want, _ = _loss_fn(state.params, acts, batches[1])
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
  for x, y in zip(before, state.vocabs["t"].map):
    np.testing.assert_array_equal(x, np.asarray(y))


def test_init_needs_the_vocabularies():
  emb, batches = _emb(1), _batches(1)
  tr = pe.make_trainer(emb, _loss_fn, optax.sgd(0.1), CONFIGS["sync"], batches[0])
  with pytest.raises(InputError, match="init_vocabularies"):
    tr.init(PARAMS, emb.init(jax.random.key(0)), batches[0])


@pytest.mark.parametrize("pipeline", ["async", "sync"])
def test_a_checkpoint_resumes_bit_for_bit(tmp_path, pipeline):
  """Saved after step 3 of 6 and resumed on the same mesh: the tables, maps
  and params equal an uninterrupted run's."""
  from pallas_emb.train.checkpoint import Checkpointer

  emb, batches = _emb(8), _batches(6)
  config = CONFIGS[pipeline]
  want, _, _ = _trainer_run(emb, config, batches)
  tr = pe.make_trainer(emb, _loss_fn, optax.sgd(0.1), config, batches[0])
  vocabs = emb.init_vocabularies(jax.random.key(1))
  fresh = lambda: tr.init(PARAMS, emb.init(jax.random.key(0)), batches[0], vocabs)
  state = fresh()
  ckpt = Checkpointer(str(tmp_path), tr)
  for t in range(3):
    state, _ = tr.step(state, batches[t], batches[t + 1])
  ckpt.save(state, {"f": (B, L), "g": (B, 1)})
  vocabs = emb.init_vocabularies(jax.random.key(1))
  state = ckpt.restore(fresh(), lambda i: batches[min(i, len(batches) - 1)])
  for t in range(3, 6):
    state, _ = tr.step(state, batches[t], batches[min(t + 1, 5)])
  state, _ = tr.flush(state)
  for name in ("t", "s"):
    np.testing.assert_array_equal(
      emb.logical_table(state.tables, name), emb.logical_table(want.tables, name)
    )
  for x, y in zip(state.vocabs["t"].map, want.vocabs["t"].map):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert jax.device_get(state.params) == jax.device_get(want.params)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_checkpoint_of_8_devices_restores_onto_4(tmp_path, pipeline):
  """Every resident id keeps its row's values and slots (bit for bit with
  nothing pending; the async pipeline's pending update, applied at restore
  on its ids' new rows, sums its gradients on 4 shards: to float rounding);
  training goes on."""
  from pallas_emb.train.checkpoint import Checkpointer

  batches, config = _batches(5), CONFIGS[pipeline]
  emb8 = _emb(8)
  tr8 = pe.make_trainer(emb8, _loss_fn, optax.sgd(0.1), config, batches[0])
  state = tr8.init(
    PARAMS, emb8.init(jax.random.key(0)), batches[0], emb8.init_vocabularies(jax.random.key(1))
  )
  for t in range(3):
    state, _ = tr8.step(state, batches[t], batches[t + 1])
  Checkpointer(str(tmp_path), tr8).save(state, {"f": (B, L), "g": (B, 1)})
  flushed, _ = tr8.flush(state)  # what the restore applies
  ids8, rows8 = emb8.resident_rows(flushed.vocabs, "t")
  table8, acc8 = emb8.logical_table(flushed.tables, "t"), emb8.logical_slots(flushed.tables, "t")

  emb4 = _emb(4)
  tr4 = pe.make_trainer(emb4, _loss_fn, optax.sgd(0.1), config, batches[0])
  template = tr4.init(
    PARAMS, emb4.init(jax.random.key(0)), batches[0], emb4.init_vocabularies(jax.random.key(1))
  )
  state4 = Checkpointer(str(tmp_path), tr4).restore(template, lambda i: batches[min(i, 4)])
  ids4, rows4 = emb4.resident_rows(state4.vocabs, "t")
  table4, acc4 = emb4.logical_table(state4.tables, "t"), emb4.logical_slots(state4.tables, "t")
  at8, at4 = dict(zip(ids8.tolist(), rows8.tolist())), dict(zip(ids4.tolist(), rows4.tolist()))
  # An id whose new window (4 slots of 16 per shard) is full is dropped.
  assert set(at4) <= set(at8) and len(at4) >= 0.9 * len(at8) > 0
  same = (
    np.testing.assert_array_equal
    if pipeline == "sync"
    else lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  )
  for x in at4:
    same(table4[at4[x]], table8[at8[x]])
    same(acc4["acc"][at4[x]], acc8["acc"][at8[x]])
  same(emb4.logical_table(state4.tables, "s"), emb8.logical_table(flushed.tables, "s"))
  state4, m = tr4.step(state4, batches[3], batches[4])
  assert np.isfinite(float(m["loss"])) and int(m["vocab"]["t"]["occupancy"]) >= len(at4)


@pytest.mark.parametrize("pipeline", sorted(CONFIGS))
def test_nnx_embed_trains_dynamic_tables_like_the_trainer(pipeline):
  from flax import nnx

  import pallas_emb.nnx as pnnx

  class Linear(nnx.Module):
    def __init__(self):
      self.scale, self.bias = nnx.Param(PARAMS["scale"]), nnx.Param(PARAMS["bias"])

    def __call__(self, acts, batch):
      params = {"scale": self.scale.get_value(), "bias": self.bias.get_value()}
      return _loss_fn(params, acts, batch)

  emb, batches = _emb(8), _batches(6)
  state, _, want = _trainer_run(emb, CONFIGS[pipeline], batches)
  embed = pnnx.Embed(
    emb,
    config=CONFIGS[pipeline],
    tables=emb.init(jax.random.key(0)),
    vocabs=emb.init_vocabularies(jax.random.key(1)),
    first_ids=batches[0]["ids"],
  )
  dense = Linear()
  pnnx.replicate(dense, embed)
  opt = nnx.Optimizer(dense, optax.sgd(0.1), wrt=nnx.Param)
  pnnx.replicate(opt, embed)
  got = []
  for t in range(len(batches)):
    m = pnnx.train_step(embed, dense, opt, batches[t], batches[min(t + 1, len(batches) - 1)])
    got.append(jax.device_get(m["vocab"]["t"]))
  pnnx.flush(embed)
  assert got == want
  for name in ("t", "s"):
    np.testing.assert_array_equal(
      emb.logical_table(embed.tables, name), emb.logical_table(state.tables, name)
    )
  vocabs = embed.vocab.get_value()
  for x, y in zip(emb.resident_rows(vocabs, "t"), emb.resident_rows(state.vocabs, "t")):
    np.testing.assert_array_equal(x, y)
  assert float(dense.bias.get_value()) == float(state.params["bias"])
  loss, _ = pnnx.evaluate(embed, dense, batches[1])
  assert np.isfinite(float(loss))
