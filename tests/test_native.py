"""The native CPU backend against the XLA oracle (pallas_emb/kernels/native.py
states the contract): dedup and per-row sums bit for bit, the optimizer math
within `native.ULP_TOLERANCE` ulps, skipped updates bit for bit, fallbacks."""

import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import child_env, make_mesh

import pallas_emb as pe
from pallas_emb.kernels import backend as backend_lib
from pallas_emb.kernels import native, native_lib
from sharding.dedup import unique_keys
from sharding.layout import SENTINEL

needs_native = pytest.mark.skipif(
  not native_lib.available(), reason=f"native library unavailable: {native_lib.status().reason}"
)

D = 16


def _emb(
  backend,
  optimizer,
  *,
  rows=97,
  num_devices=1,
  dtype=jnp.float32,
  unique_capacity=None,
  init=jax.nn.initializers.normal(1.0),
):
  table = pe.TableSpec(
    "t",
    rows,
    D,
    optimizer=optimizer,
    dtype=dtype,
    unique_capacity=unique_capacity,
    initializer=init,
  )
  feats = [pe.FeatureSpec("bag", "t", "sum"), pe.FeatureSpec("seq", "t", None)]
  return pe.ShardedEmbedding([table], feats, make_mesh(num_devices), "x", backend)


def _batch(rng, rows, batch=32):
  """Zipf-like ids with repeats, padding (-1) and invalid ids (>= rows)."""
  ids = {
    "bag": (rng.zipf(1.3, (batch, 3)) - 1) % (rows + 4) - 1,
    "seq": rng.integers(-1, rows + 2, (batch, 2)),
  }
  return {k: v.astype(np.int32) for k, v in ids.items()}


def _grads(rng, batch=32):
  return {
    "bag": rng.normal(size=(batch, D)).astype(np.float32),
    "seq": rng.normal(size=(batch, 2, D)).astype(np.float32),
  }


def _step(emb, state, ids, grads, gate=True):
  """One update of a copy of `state` (the update donates its state)."""
  state = jax.tree.map(lambda x: jnp.array(x, copy=True), state)
  return emb.apply_gradients(state, emb.plan(ids), grads, gate=gate)


def _host(state):
  s = state["t"]
  return np.asarray(s.table), {k: np.asarray(v) for k, v in s.slots.items()}


def test_the_library_is_built_where_a_compiler_is():
  status = native_lib.status()
  if shutil.which(os.environ.get("CXX", "c++")) is None:
    # No compiler: pip install . builds no library, and the XLA path runs.
    assert not status.available and status.reason
  else:
    assert status.available, status.reason


@needs_native
def test_native_is_the_default_on_cpu(monkeypatch):
  monkeypatch.delenv(backend_lib.ENV_VAR, raising=False)
  assert backend_lib.default_backend() == "native"


def test_without_the_library_xla_runs_and_native_is_refused(monkeypatch):
  monkeypatch.delenv(backend_lib.ENV_VAR, raising=False)
  monkeypatch.setattr(
    native_lib, "status", lambda: native_lib.Status(False, None, "not built here")
  )
  assert backend_lib.default_backend() == "xla"
  assert not native.supports(pe.RowWiseAdagrad(), jnp.float32)
  with pytest.raises(pe.BackendError, match=r"'native' is unavailable: not built here"):
    pe.ShardedEmbedding([pe.TableSpec("t", 8, D)], [], make_mesh(1), backend="native")


@needs_native
@pytest.mark.parametrize("case", ["overflow", "roomy", "all_sentinel", "one_key"])
def test_unique_keys_equal_the_sort_bit_for_bit(case):
  rng = np.random.default_rng(3)
  keys = rng.integers(-40, 40, 300).astype(np.int32)
  keys[rng.random(300) < 0.2] = SENTINEL
  capacity = {"overflow": 24, "roomy": 128, "all_sentinel": 8, "one_key": 8}[case]
  if case == "all_sentinel":
    keys[:] = SENTINEL
  if case == "one_key":
    keys = np.array([5], np.int32)
  want = jax.jit(lambda k: unique_keys(k, capacity))(keys)
  got = jax.jit(lambda k: unique_keys(k, capacity, impl=native.unique_keys))(keys)
  # The native dedup returns what a lookup reads (keys, inverse, counts),
  # not the sorted copy of its input that only a stacked table's counts use.
  for name in ("keys", "inverse", "num_unique", "num_overflow", "num_invalid"):
    np.testing.assert_array_equal(
      np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name
    )


@needs_native
def test_one_device_row_sums_equal_xla_bit_for_bit():
  # SGD with lr 1 on a zero table writes -sum into each row: 0 + g * -1 is
  # exact, so the table shows the per-row sums themselves. Normal gradients
  # make every sum depend on its order of addition.
  rng = np.random.default_rng(0)
  ids, grads = _batch(rng, 97), _grads(rng)
  tables = {}
  for b in ("xla", "native"):
    emb = _emb(b, pe.SGD(1.0), unique_capacity=40, init=jax.nn.initializers.zeros)
    state, m = _step(emb, emb.init(jax.random.key(0)), ids, grads)
    tables[b], metrics = _host(state)[0], m["t"]
    assert int(metrics.overflow_ids) > 0 and int(metrics.invalid_ids) > 0
  np.testing.assert_array_equal(tables["native"], tables["xla"])


def _assert_within_ulps(got, want, old, what):
  """|got - want| <= ULP_TOLERANCE ulps of max(|old|, |want|, |want - old|);
  rows the oracle left alone are equal bit for bit."""
  got, want, old = (np.asarray(x, np.float32) for x in (got, want, old))
  scale = np.maximum(np.maximum(np.abs(old), np.abs(want)), np.abs(want - old))
  tol = native.ULP_TOLERANCE * np.spacing(scale)
  err = np.abs(got.astype(np.float64) - want.astype(np.float64))
  bad = err > tol
  assert not bad.any(), (
    f"{what}: {bad.sum()} of {bad.size} elements beyond "
    f"{native.ULP_TOLERANCE} ulps, worst {np.max(err / tol):.1f}x"
  )
  same = (want == old).all(axis=-1)
  np.testing.assert_array_equal(got[same], want[same], err_msg=what)


NATIVE_OPTIMIZERS = {
  "SGD": pe.SGD(0.5),
  "Adagrad": pe.Adagrad(0.25),
  "RowWiseAdagrad": pe.RowWiseAdagrad(0.1),
  "RowWiseAdagrad_decays": pe.RowWiseAdagrad(0.1, half_life_steps=3.0, weight_decay=0.01),
  "RowWiseAdagrad_lazy": pe.RowWiseAdagrad(0.1, half_life_steps=3.0, lazy_decay=True),
  "LazyAdam": pe.LazyAdam(0.05),
  "LazyAdam_no_b1": pe.LazyAdam(0.05, b1=0.0, b2=0.99, eps=1e-3),
  "FTRL": pe.FTRL(0.5),
  "FTRL_regularized": pe.FTRL(0.5, l1=0.05, l2=0.1, beta=0.5, initial_accumulator_value=0.0),
  "FTRL_linear_times_lr": pe.FTRL(
    0.5, l1=0.05, l2=0.1, beta=0.5, multiply_linear_by_learning_rate=True
  ),
  "FTRL_power_0": pe.FTRL(0.5, learning_rate_power=0.0, l2=0.1),
  # A schedule's lr == 0 at the first step: that step leaves rows and slots.
  "FTRL_warmup": pe.FTRL(lambda step: jnp.where(step < 1, 0.0, 0.5)),
}


def _assert_slot(got, want, old, name):
  if np.issubdtype(np.asarray(want).dtype, np.integer):  # counts, steps
    np.testing.assert_array_equal(got, want, err_msg=name)
  else:
    _assert_within_ulps(got, want, old, name)


# The quick loop's subset (conftest): on four devices, the optimizers with the
# most math (lazy decays, no first moment, regularisation).
QUICK = {
  "test_optimizer_math_is_within_the_stated_ulps": lambda p: (
    p["num_devices"] == 4
    and p["name"] in ("RowWiseAdagrad_lazy", "LazyAdam_no_b1", "FTRL_regularized")
  )
}


@needs_native
@pytest.mark.parametrize("num_devices", [1, 4])
@pytest.mark.parametrize("name", list(NATIVE_OPTIMIZERS))
def test_optimizer_math_is_within_the_stated_ulps(name, num_devices):
  opt = NATIVE_OPTIMIZERS[name]
  rng = np.random.default_rng(1)
  batches = [(_batch(rng, 97), _grads(rng)) for _ in range(3)]
  embs = {b: _emb(b, opt, num_devices=num_devices) for b in ("xla", "native")}
  assert native.supports(opt, jnp.float32)
  state = embs["xla"].init(jax.random.key(2))
  for ids, grads in batches:  # later steps start from non-initial slots
    old = _host(state)
    new = {b: _host(_step(e, state, ids, grads)[0]) for b, e in embs.items()}
    _assert_within_ulps(new["native"][0], new["xla"][0], old[0], "table")
    for k in old[1]:
      _assert_slot(new["native"][1][k], new["xla"][1][k], old[1][k], k)
    state = _step(embs["xla"], state, ids, grads)[0]


@needs_native
@pytest.mark.parametrize(
  "opt,dtype",
  [(pe.FTRL(0.5, learning_rate_power=-0.25), jnp.float32), (pe.RowWiseAdagrad(0.1), jnp.bfloat16)],
  ids=["FTRL_power", "bf16"],
)
def test_what_native_does_not_implement_runs_xla_bit_for_bit(opt, dtype):
  assert not native.supports(opt, dtype)
  rng = np.random.default_rng(2)
  ids, grads = _batch(rng, 97), _grads(rng)
  out = {}
  for b in ("xla", "native"):
    emb = _emb(b, opt, dtype=dtype)
    out[b] = _host(_step(emb, emb.init(jax.random.key(3)), ids, grads)[0])
  np.testing.assert_array_equal(out["native"][0], out["xla"][0])
  for k in out["xla"][1]:
    np.testing.assert_array_equal(out["native"][1][k], out["xla"][1][k])


@needs_native
@pytest.mark.parametrize("name", ["RowWiseAdagrad", "RowWiseAdagrad_lazy", "LazyAdam", "FTRL"])
@pytest.mark.parametrize("bad", ["nan_last", "overflow", "gate_false"])
def test_a_skipped_update_leaves_every_row_bit_for_bit(bad, name):
  # Enough rows for several chunks: rows written before the norm is known
  # must come back from the undo log, with every slot (wide, per-row, int).
  rows, batch = 4096, 512
  emb = _emb("native", NATIVE_OPTIMIZERS[name], rows=rows)
  rng = np.random.default_rng(4)
  state, _ = _step(emb, emb.init(jax.random.key(5)), _batch(rng, rows, batch), _grads(rng, batch))
  before = _host(state)
  ids, grads = _batch(rng, rows, batch), _grads(rng, batch)
  if bad == "nan_last":  # the last token: every other row is already updated
    grads["seq"][-1, -1, 0] = np.nan
  if bad == "overflow":  # finite gradients whose norm overflows float32
    grads["bag"][:4] = np.float32(3e38)
  state, m = _step(emb, state, ids, grads, gate=bad != "gate_false")
  assert not bool(m["t"].applied)
  after = _host(state)
  np.testing.assert_array_equal(after[0], before[0])
  for k in before[1]:
    np.testing.assert_array_equal(after[1][k], before[1][k], err_msg=k)


@needs_native
def test_squares_past_float32_still_apply_like_xla():
  # Finite gradients whose squares overflow float32 but whose norm does
  # not: both paths apply the update and report the same norm.
  rng = np.random.default_rng(6)
  ids, grads = _batch(rng, 97), _grads(rng)
  grads["bag"] *= np.float32(3e19)
  got = {}
  for b in ("xla", "native"):
    emb = _emb(b, pe.SGD(1e-20))
    got[b] = _step(emb, emb.init(jax.random.key(7)), ids, grads)[1]["t"]
  assert bool(got["native"].applied) and bool(got["xla"].applied)
  np.testing.assert_allclose(float(got["native"].grad_norm), float(got["xla"].grad_norm), rtol=1e-5)


@needs_native
def test_the_native_step_updates_table_and_slots_in_place():
  # 256 rows: row-wise Adagrad's accumulator is stored lane-dense (2, 128).
  # A copy of the table or of a slot would cost a pass over it every step.
  emb = _emb("native", pe.RowWiseAdagrad(0.1), rows=256)
  state = emb.init(jax.random.key(8))
  ids, grads = _batch(np.random.default_rng(8), 256), _grads(np.random.default_rng(8))
  step = jax.jit(lambda s, i, g: emb.apply_gradients(s, emb.plan(i), g)[0], donate_argnums=0)
  hlo = step.lower(state, ids, grads).compile().as_text()
  assert "PeRowwiseAdagradSegsumUpdate" in hlo
  shapes = [
    f"f32[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(state["t"]) if x.ndim == 2
  ]
  copies = [
    l
    for l in hlo.splitlines()
    if any(f"= {s}" in l for s in shapes) and ("copy" in l.split("=", 1)[1])
  ]
  assert not copies, copies


# One step of a few native rules on 1 device (the one pass) and on 2 (the
# owner-side row update); prints a digest of every table and slot.
_DIGEST_SCRIPT = textwrap.dedent("""
    import hashlib, jax, numpy as np
    import pallas_emb as pe
    opts = [pe.RowWiseAdagrad(0.1, half_life_steps=3.0, weight_decay=0.01),
            pe.LazyAdam(0.05), pe.FTRL(0.5, l1=0.05, l2=0.1, beta=0.5)]
    rng = np.random.default_rng(0)
    ids = rng.integers(-1, 300, (256, 3)).astype(np.int32)
    grads = rng.normal(size=(256, 16)).astype(np.float32)
    digest = hashlib.sha256()
    for devices in (1, 2):
      mesh = jax.sharding.Mesh(np.array(jax.devices()[1:1 + devices]), ("x",))
      for opt in opts:
        emb = pe.ShardedEmbedding([pe.TableSpec("t", 300, 16, optimizer=opt)],
                                  [pe.FeatureSpec("f", "t", "sum")], mesh, "x",
                                  "native")
        state = emb.init(jax.random.key(1))
        state, _ = emb.apply_gradients(state, emb.plan({"f": ids}), {"f": grads})
        for leaf in jax.tree.leaves(state):
          digest.update(np.asarray(leaf).tobytes())
    print(digest.hexdigest())
""")


@needs_native
@pytest.mark.slow
def test_every_instruction_set_gives_the_same_bits():
  # The kernels run in the widest instruction set the CPU has; each rounds
  # every operation once in the same order (csrc/sparse_update.h).
  digests = {}
  for isa in ("base", "avx512"):
    env = child_env(PE_NATIVE_ISA=isa)
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=3"
    out = subprocess.run(
      [sys.executable, "-c", _DIGEST_SCRIPT],
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
      check=True,
    )
    digests[isa] = out.stdout.strip().splitlines()[-1]
  assert digests["base"] == digests["avx512"], digests
