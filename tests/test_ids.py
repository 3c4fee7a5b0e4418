"""64-bit ids: accepted everywhere ids go in, never wrapped onto a row.

NumPy int64 ids >= 2**31 (or < -2**31) would wrap onto a real row if cast,
or if JAX canonicalised them at a jit boundary (x64 off). They must count as
invalid instead, on 1 and 8 devices, sync and async, and with x64 on.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_emb as pe
from pallas_emb import async_emb
from pallas_emb.data.feed import GlobalBatches

V, D, B = 40, 8, 16
# Each of these wraps onto row 5, 9 or 0 as int32; none may touch a row.
WIDE = [2**32 + 5, 2**32 + 9, 2**31, -(2**31) - 1, 2**63 - 1, -(2**32)]


def _ids(rng):
  """(B, 2) int64: valid ids in [10, V), padding, and the WIDE ids; rows
  0, 5 and 9 are never looked up validly."""
  ids = rng.integers(10, V, (B, 2)).astype(np.int64)
  ids[: len(WIDE), 0] = WIDE
  ids[-1, 1] = -1
  return ids


def test_int32_ids_converts_on_the_host_and_in_the_graph():
  x = np.array([5, 2**32 + 5, 2**31, 2**31 - 1, -(2**31), -(2**31) - 1, -1], np.int64)
  want = [5, -2, -2, 2**31 - 1, -(2**31), -2, -1]
  got = pe.int32_ids(x)
  assert isinstance(got, np.ndarray) and got.dtype == np.int32 and got.tolist() == want
  assert pe.int32_ids(np.array([2**63 + 5, 7], np.uint64)).tolist() == [-2, 7]
  assert pe.int32_ids(np.array([2**31, 3], np.uint32)).tolist() == [-2, 3]
  assert pe.int32_ids(np.array([-3, 4], np.int16)).dtype == np.int32
  same = np.arange(3, dtype=np.int32)
  assert pe.int32_ids(same) is same
  out = pe.int32_ids({"f": x, "label": np.ones(2, np.float32)})
  assert out["f"].tolist() == want and out["label"].dtype == np.float32
  # JAX arrays (uint32 exists with x64 off) convert in the graph.
  u = jnp.asarray(np.array([2**31 + 1, 6], np.uint32))
  assert jax.jit(pe.int32_ids)(u).tolist() == [-2, 6]


def _emb(n, opt=None):
  table = pe.TableSpec("t", V, D, optimizer=opt or pe.SGD(1.0))
  return pe.ShardedEmbedding([table], [pe.FeatureSpec("f", "t", "sum")], make_mesh(n), "x", "xla")


def _check_untouched(before, after):
  np.testing.assert_array_equal(after[[0, 5, 9]], before[[0, 5, 9]])
  assert (after[10:] != before[10:]).any()


@pytest.mark.parametrize("num_devices", [1, 8])
def test_sync_int64_ids_beyond_int32_are_invalid_and_touch_no_row(num_devices):
  emb = _emb(num_devices)
  state = emb.init(jax.random.key(0))
  before = emb.logical_table(state, "t")
  ids = _ids(np.random.default_rng(0))
  acts, res = emb.lookup(state, {"f": ids})
  # A wide id reads a zero row: example 0 sums only its valid second id.
  np.testing.assert_allclose(acts["f"][0], before[ids[0, 1]], rtol=1e-6)
  planned = emb.plan({"f": ids})["t"]
  np.testing.assert_array_equal(planned.plan.send_keys, res["t"].plan.send_keys)
  state, m = emb.apply_gradients(state, res, {"f": np.ones((B, D), np.float32)})
  assert int(m["t"].invalid_ids) == len(WIDE)
  _check_untouched(before, emb.logical_table(state, "t"))
  # The same as int32 ids with the wide ones replaced by an invalid id.
  ref = _emb(num_devices)
  ref_state = ref.init(jax.random.key(0))
  _, ref_res = ref.lookup(ref_state, {"f": np.where(np.abs(ids) < 2**31, ids, -2).astype(np.int32)})
  ref_state, _ = ref.apply_gradients(ref_state, ref_res, {"f": np.ones((B, D), np.float32)})
  np.testing.assert_array_equal(emb.logical_table(state, "t"), ref.logical_table(ref_state, "t"))


@pytest.mark.parametrize("num_devices", [1, 8])
def test_async_int64_ids_beyond_int32_are_invalid_and_touch_no_row(num_devices):
  emb = _emb(num_devices)
  ids = {"f": _ids(np.random.default_rng(1))}
  ctx = async_emb.context_handles(emb, ids)["t"]
  state = emb.init(jax.random.key(0))
  before = emb.logical_table(state, "t")
  lookup = pe.lookup_start(ctx, state["t"].table, ids)
  update = pe.make_gradient_update(ctx, lookup, {"f": jnp.ones((B, D))})
  _, table, opt_state, m = pe.gradient_update_start(
    ctx, update, state["t"].table, pe.EmbOptState(state["t"].slots, state["t"].step)
  )
  _, valid, _ = pe.gradient_update_done(ctx)
  assert bool(valid) and int(m["invalid_ids"]) == len(WIDE)
  after = emb.logical_table({"t": pe.TableState(table, opt_state.slots, opt_state.step)}, "t")
  _check_untouched(before, after)


def _loss_fn(params, acts, batch):
  logit = jnp.sum(acts["f"] * batch["w"], axis=1) + params["bias"]
  return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, batch["y"])), {}


def test_trainer_and_global_batches_convert_int64_ids_before_jit():
  emb = _emb(8, pe.FTRL(0.5))
  rng = np.random.default_rng(2)
  batches = [
    {
      "ids": {"f": _ids(rng)},
      "w": rng.normal(size=(B, D)).astype(np.float32),
      "y": (rng.random(B) < 0.5).astype(np.float32),
    }
    for _ in range(3)
  ]
  feed = GlobalBatches(None, B, NamedSharding(emb.mesh, P("x")))
  fed = feed.put(batches[0])["ids"]["f"]
  assert fed.dtype == jnp.int32
  np.testing.assert_array_equal(fed, pe.int32_ids(batches[0]["ids"]["f"]))
  tables = []
  tr = pe.make_trainer(emb, _loss_fn, optax.sgd(0.1), pe.TrainConfig(), batches[0])
  for convert in (False, True):
    run = [dict(b, ids=pe.int32_ids(b["ids"])) if convert else b for b in batches]
    state = tr.init({"bias": jnp.float32(0.0)}, emb.init(jax.random.key(0)), run[0])
    before = emb.logical_table(state.tables, "t")
    for t in range(3):
      state, m = tr.step(state, run[t], run[min(t + 1, 2)])
    assert int(m["emb"]["t"]["invalid_ids"]) == len(WIDE)
    tr.evaluate(state, run[0])
    state, _ = tr.flush(state)
    tables.append(emb.logical_table(state.tables, "t"))
    _check_untouched(before, tables[-1])
  np.testing.assert_array_equal(tables[0], tables[1])


_X64_SCRIPT = textwrap.dedent("""
    import json
    from test_ids import B, D, _emb, _ids, _loss_fn  # conftest sets the devices
    import jax
    jax.config.update("jax_enable_x64", True)  # before any use of JAX
    import jax.numpy as jnp, numpy as np, optax
    import pallas_emb as pe
    emb = _emb(8)
    ids = jnp.asarray(_ids(np.random.default_rng(0)))  # int64 on the device
    out = {"dtype": str(ids.dtype)}

    @jax.jit
    def step(state, ids):  # int64 ids traced: converted in the graph
      acts, res = emb.lookup(state, {"f": ids})
      return emb.apply_gradients(state, res, {"f": jnp.ones((B, D), jnp.float32)})

    state = emb.init(jax.random.key(0))
    before = emb.logical_table(state, "t")
    state, m = step(state, ids)
    after = emb.logical_table(state, "t")
    out["sync_invalid"] = int(m["t"].invalid_ids)
    out["sync_touched"] = sorted(set(np.nonzero((after != before).any(1))[0].tolist()))
    rng = np.random.default_rng(2)
    batch = {"ids": {"f": ids}, "w": rng.normal(size=(B, D)).astype(np.float32),
             "y": (rng.random(B) < 0.5).astype(np.float32)}
    tr = pe.make_trainer(emb, _loss_fn, optax.sgd(0.1), pe.TrainConfig(), batch)
    tstate = tr.init({"bias": jnp.float32(0.0)}, emb.init(jax.random.key(0)), batch)
    for _ in range(2):
      tstate, tm = tr.step(tstate, batch, batch)
    tstate, _ = tr.flush(tstate)
    trained = emb.logical_table(tstate.tables, "t")
    out["async_invalid"] = int(tm["emb"]["t"]["invalid_ids"])
    out["async_touched"] = sorted(set(np.nonzero((trained != before).any(1))[0].tolist()))
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_x64_enabled_converts_in_the_graph():
  here = os.path.dirname(os.path.abspath(__file__))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), env.get("PYTHONPATH", "")])
  proc = subprocess.run(
    [sys.executable, "-c", _X64_SCRIPT],
    env=env,
    cwd=here,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  ids = _ids(np.random.default_rng(0))
  valid = sorted(set(ids[(ids >= 10) & (ids < V)].tolist()))
  assert out["dtype"] == "int64"
  assert out["sync_invalid"] == out["async_invalid"] == len(WIDE)
  assert out["sync_touched"] == out["async_touched"] == valid
