"""The Flax NNX layer trains the main job's model exactly as the functional
Trainer does, refuses what the Trainer refuses, and checkpoints as NNX state."""

import jax
import numpy as np
import optax
import pytest

flax = pytest.importorskip("flax")  # the `flax` extra (in `test`)
from conftest import make_mesh  # noqa: E402
from flax import nnx  # noqa: E402

import pallas_emb as pe  # noqa: E402
from pallas_emb import data as data_lib  # noqa: E402
from pallas_emb import nnx as pnnx  # noqa: E402
from pallas_emb.data.feed import GlobalBatches  # noqa: E402
from pallas_emb.job.model import build_ranking  # noqa: E402
from pallas_emb.job.nnx_model import RankingMLP  # noqa: E402

STEPS = 3


def _job(num_devices, optimizer=None, kind="auto"):
  dataset = data_lib.SyntheticClickLog(num_users=200, num_items=120, eval_examples=64)
  emb, model = build_ranking(
    dataset,
    make_mesh(num_devices, kind=kind),
    emb_dim=8,
    backend="xla",
    hidden=(16,),
    optimizer=optimizer or pe.RowWiseAdagrad(0.05, half_life_steps=None),
  )
  return emb, model, GlobalBatches(dataset, 32, emb.sharding())


def _nnx_model(emb, model, feeder, config, key):
  embed = pnnx.Embed(
    emb, key=jax.random.fold_in(key, 2), config=config, first_ids=feeder.train(0)["ids"]
  )
  dense = RankingMLP(model, jax.random.fold_in(key, 1))
  pnnx.replicate(dense, embed)
  opt = nnx.Optimizer(dense, optax.adam(1e-3), wrt=nnx.Param)
  pnnx.replicate(opt, embed)
  return embed, dense, opt


def _train_nnx(embed, dense, opt, feeder, start, stop):
  return [
    float(pnnx.train_step(embed, dense, opt, feeder.train(t), feeder.train(t + 1))["loss"])
    for t in range(start, stop)
  ]


def _functional(emb, model, feeder, config, key):
  trainer = pe.make_trainer(emb, model.loss, optax.adam(1e-3), config, feeder.train(0))
  state = trainer.init(
    model.init(jax.random.fold_in(key, 1)), emb.init(jax.random.fold_in(key, 2)), feeder.train(0)
  )
  losses = []
  for t in range(STEPS):
    state, m = trainer.step(state, feeder.train(t), feeder.train(t + 1))
    losses.append(float(m["loss"]))
  state, _ = trainer.flush(state)
  return state, losses


def _assert_same_state(embed, dense, state):
  for name, ts in state.tables.items():
    np.testing.assert_array_equal(
      np.asarray(embed.table.get_value()[name]), np.asarray(ts.table), name
    )
    for slot, v in ts.slots.items():
      np.testing.assert_array_equal(np.asarray(embed.slots.get_value()[name][slot]), np.asarray(v))
    np.testing.assert_array_equal(np.asarray(embed.step.get_value()[name]), np.asarray(ts.step))
  for got, want in zip(dense.params(), state.params):
    for k in ("w", "b"):
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


@pytest.mark.parametrize(
  "num_devices,config,kind",
  [
    (8, pe.TrainConfig(), "auto"),
    (8, pe.TrainConfig(use_async_emb=False), "auto"),
    (1, pe.TrainConfig(exact=True), "auto"),
    (8, pe.TrainConfig(), "explicit"),
  ],
  ids=["async-8", "sync-8", "exact-1", "async-8-explicit"],
)
@pytest.mark.slow
def test_nnx_trains_bit_for_bit_like_the_functional_trainer(num_devices, config, kind):
  emb, model, feeder = _job(num_devices, kind=kind)
  key = jax.random.key(0)
  state, want = _functional(emb, model, feeder, config, key)
  embed, dense, opt = _nnx_model(emb, model, feeder, config, key)
  got = _train_nnx(embed, dense, opt, feeder, 0, STEPS)
  pnnx.flush(embed)
  assert got == want
  assert want[-1] != want[0]  # it trained
  _assert_same_state(embed, dense, state)
  loss, _ = pnnx.evaluate(embed, dense, next(feeder.eval())[0])
  assert np.isfinite(float(loss))


def test_an_optimizer_without_a_fused_update_is_refused_at_construction():
  emb, _, feeder = _job(8, optimizer=pe.OptaxRows(optax.adam(1e-3)))
  with pytest.raises(pe.ConfigError) as nnx_err:
    pnnx.Embed(
      emb, key=jax.random.key(0), config=pe.TrainConfig(), first_ids=feeder.train(0)["ids"]
    )
  with pytest.raises(pe.ConfigError) as config_err:
    pe.validate_config(pe.TrainConfig(), emb)
  assert str(nnx_err.value) == str(config_err.value)
  assert "OptaxRows has no fused table update" in str(nnx_err.value)
  # The synchronous update takes any optimizer.
  pnnx.Embed(emb, key=jax.random.key(0), config=pe.TrainConfig(use_async_emb=False))


@pytest.mark.slow
def test_nnx_state_checkpoints_through_orbax_and_resumes_exactly(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  emb, model, feeder = _job(8)
  config, key = pe.TrainConfig(), jax.random.key(0)
  embed, dense, opt = _nnx_model(emb, model, feeder, config, key)
  whole = _train_nnx(embed, dense, opt, feeder, 0, STEPS)

  embed2, dense2, opt2 = _nnx_model(emb, model, feeder, config, key)
  first = _train_nnx(embed2, dense2, opt2, feeder, 0, STEPS // 2)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", nnx.state((embed2, dense2, opt2)))
  # A fresh model (other initial values), restored from the checkpoint: the
  # pending update and the started lookup of the next batch come back too.
  embed3, dense3, opt3 = _nnx_model(emb, model, feeder, config, jax.random.key(7))
  target = nnx.state((embed3, dense3, opt3))
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "ckpt", target)
  nnx.update((embed3, dense3, opt3), restored)
  rest = _train_nnx(embed3, dense3, opt3, feeder, STEPS // 2, STEPS)
  assert first + rest == whole
  for e in (embed, embed3):
    pnnx.flush(e)
  for name in embed.table.get_value():
    np.testing.assert_array_equal(
      np.asarray(embed.table.get_value()[name]), np.asarray(embed3.table.get_value()[name])
    )
  for a, b in zip(dense.params(), dense3.params()):
    np.testing.assert_array_equal(np.asarray(a["w"]), np.asarray(b["w"]))
