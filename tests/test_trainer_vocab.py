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

  def dense(params, opt_state, acts, batch):
    with jax.sharding.set_mesh(emb.mesh):
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


def test_the_trainer_checkpointer_refuses_maps_it_does_not_save(tmp_path):
  from pallas_emb.errors import CheckpointError
  from pallas_emb.train.checkpoint import Checkpointer

  emb, batches = _emb(1), _batches(2)
  state, tr, _ = _trainer_run(emb, CONFIGS["sync"], batches)
  with pytest.raises(CheckpointError, match="VocabCheckpointer"):
    Checkpointer(str(tmp_path), tr).save(state, {"f": (B, L), "g": (B, 1)})


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
