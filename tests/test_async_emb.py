"""The async interface: protocol, config validation, handle misuse, pipelines."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh

import pallas_emb as pe
from pallas_emb import async_emb

SEED_MESSAGE = (
  "use_async_emb requires an embedding optimizer implementing "
  "AsyncEmbOptimizer, and {} has no fused table update"
)

V, D, B = 53, 8, 16


# -- the protocol and the config ---------------------------------------------


class NeitherMethod(pe.AsyncEmbOptimizer):
  pass


class OnlyStart(pe.AsyncEmbOptimizer):
  def gradient_update_start(self, context, update, table, state, gate=None):
    return (), table, state, {}


class OnlyDone(pe.AsyncEmbOptimizer):
  def gradient_update_done(self, context, gate=None):
    return 0.0, True, 0


class Both(pe.AsyncEmbOptimizer):
  def gradient_update_start(self, context, update, table, state, gate=None):
    return (), table, state, {}

  def gradient_update_done(self, context, gate=None):
    return 0.0, True, 0


@pytest.mark.parametrize(
  "cls,missing",
  [
    (NeitherMethod, ["gradient_update_start", "gradient_update_done"]),
    (OnlyStart, ["gradient_update_done"]),
    (OnlyDone, ["gradient_update_start"]),
  ],
)
def test_protocol_defaults_raise_the_seed_message(cls, missing):
  opt = cls()
  assert isinstance(opt, pe.AsyncEmbOptimizer)  # isinstance alone is not enough
  assert not pe.supports_async_emb(opt)
  calls = {
    "gradient_update_start": lambda: opt.gradient_update_start(None, None, None, None, None),
    "gradient_update_done": lambda: opt.gradient_update_done(None, None),
  }
  for name in missing:
    with pytest.raises(NotImplementedError) as e:
      calls[name]()
    assert str(e.value) == SEED_MESSAGE.format(cls.__name__)


def test_supports_async_emb():
  assert pe.supports_async_emb(Both())
  for opt in (
    pe.SGD(),
    pe.Adagrad(),
    pe.RowWiseAdagrad(),
    pe.LazyAdam(),
    pe.AsyncEmbAdam(),
    pe.FTRL(),
  ):
    assert pe.supports_async_emb(opt), opt
  assert not pe.supports_async_emb(pe.OptaxRows(optax.adam(1e-3)))
  assert not pe.supports_async_emb(object())
  assert pe.AsyncEmbAdam is pe.LazyAdam
  assert async_emb.registered_async_emb_optimizers() == (
    pe.SGD,
    pe.Adagrad,
    pe.RowWiseAdagrad,
    pe.LazyAdam,
    pe.FTRL,
  )


def test_validate_config_refuses_the_optax_wrapper_in_async_mode():
  opt = pe.OptaxRows(optax.adam(1e-3))
  with pytest.raises(pe.ConfigError) as e:
    pe.validate_config(pe.TrainConfig(use_async_emb=True), opt)
  msg = str(e.value)
  assert isinstance(e.value, ValueError)
  assert SEED_MESSAGE.format("OptaxRows") in msg
  for alternative in (
    "SGD",
    "Adagrad",
    "RowWiseAdagrad",
    "LazyAdam",
    "AsyncEmbAdam",
    "FTRL",
    "use_async_emb=False",
  ):
    assert alternative in msg
  pe.validate_config(pe.TrainConfig(use_async_emb=False), opt)
  pe.validate_config(pe.TrainConfig(use_async_emb=True), pe.RowWiseAdagrad())


def test_make_trainer_refuses_before_tracing():
  emb = _emb(8, pe.OptaxRows(optax.sgd(0.1)))
  traced = []

  def loss_fn(params, acts, batch):
    traced.append(1)
    return jnp.sum(acts["f"]), {}

  with pytest.raises(pe.ConfigError, match="OptaxRows has no fused table update"):
    pe.make_trainer(emb, loss_fn, optax.sgd(0.1), pe.TrainConfig(), _batches(1)[0])
  assert not traced
  with pytest.raises(pe.ConfigError, match="needs use_async_emb=True"):
    pe.TrainConfig(use_async_emb=False, exact=True)


def test_optax_rows_is_lazy_adam_in_the_sync_path():
  opt_a, opt_b = pe.OptaxRows(optax.adam(0.01)), pe.LazyAdam(0.01)
  tables = []
  for opt in (opt_a, opt_b):
    emb = _emb(8, opt)
    state = emb.init(jax.random.key(0))
    for batch in _batches(3):
      acts, res = emb.lookup(state, batch["ids"])
      state, _ = emb.apply_gradients(state, res, {"f": batch["w"]})
    tables.append(emb.logical_table(state, "t"))
  np.testing.assert_allclose(tables[0], tables[1], rtol=1e-5, atol=1e-6)


# -- the context handle -------------------------------------------------------


def _emb(n, opt=None, backend="xla", kind="auto", placement="auto"):
  opt = opt or pe.RowWiseAdagrad(0.2, half_life_steps=None)
  table = pe.TableSpec("t", V, D, optimizer=opt, placement=placement)
  return pe.ShardedEmbedding(
    [table], [pe.FeatureSpec("f", "t", "sum")], make_mesh(n, kind=kind), "x", backend
  )


def _batches(n, seed=0, nan_at=None):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    ids = rng.integers(-1, V, (B, 3)).astype(np.int32)
    w = (rng.integers(-8, 9, (B, D)) / 8).astype(np.float32)
    out.append(
      {
        "ids": {"f": ids},
        "w": w,
        "y": (rng.random(B) < 0.5).astype(np.float32),
        "nan": np.float32(np.nan if i == nan_at else 0.0),
      }
    )
  return out


def _ctx(emb):
  return async_emb.context_handles(emb, _batches(1)[0]["ids"])["t"]


def test_make_context_handle_validates():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[1:9]).reshape(2, 4), ("r", "x"))
  t = pe.TableSpec("t", V, D, optimizer=pe.SGD())
  ok = dict(data_axis="x", tokens_per_batch=32, emb_width=D, num_unique=16, table=t)
  ctx = pe.make_context_handle(mesh, "x", **ok)
  assert ctx.group_size == 4 and ctx.tokens_per_rank == 8
  assert pe.make_context_handle(mesh, "x", **{**ok, "tokens_per_batch": np.int64(32)}) == ctx
  with pytest.raises(ValueError, match=r"tokens_per_batch must be an int, got 32.0 of type float"):
    pe.make_context_handle(mesh, "x", **{**ok, "tokens_per_batch": 32.0})
  assert hash(ctx) == hash(pe.make_context_handle(mesh, "x", **ok))
  with pytest.raises(
    ValueError, match=r"table_axis 'z' is not a mesh axis; the mesh axes are \('r', 'x'\)"
  ):
    pe.make_context_handle(mesh, "z", **ok)
  with pytest.raises(ValueError, match=r"data_axis 'q' is not a mesh axis"):
    pe.make_context_handle(mesh, "x", **{**ok, "data_axis": "q"})
  with pytest.raises(ValueError, match=r"table_axis 'x' is missing from data_axis \('r',\)"):
    pe.make_context_handle(mesh, "x", **{**ok, "data_axis": "r"})
  with pytest.raises(ValueError, match=r"more than one token shard per communicator rank"):
    pe.make_context_handle(mesh, "x", **{**ok, "data_axis": ("r", "x")})
  with pytest.raises(
    ValueError, match=r"tokens_per_batch=30 must be a positive multiple of the group size 4"
  ):
    pe.make_context_handle(mesh, "x", **{**ok, "tokens_per_batch": 30})
  with pytest.raises(ValueError, match=r"emb_width=4 does not match table 't'"):
    pe.make_context_handle(mesh, "x", **{**ok, "emb_width": 4})
  with pytest.raises(ValueError, match=r"num_devices_per_node=3 must divide the 8 devices"):
    pe.make_context_handle(mesh, "x", **ok, num_devices_per_node=3)


def _start_args(emb, ctx, state):
  lookup = pe.lookup_start(ctx, state["t"].table, _batches(1)[0]["ids"])
  update = pe.make_gradient_update(ctx, lookup, {"f": jnp.ones((B, D))})
  return lookup, update, pe.EmbOptState(state["t"].slots, state["t"].step)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_misuse_raises_async_emb_state_error(jit):
  emb = _emb(8)
  ctx = _ctx(emb)
  state = emb.init(jax.random.key(0))
  _, update, opt_state = _start_args(emb, ctx, state)
  wrap = jax.jit if jit else (lambda f: f)

  @wrap
  def done_without_start():
    return pe.gradient_update_done(ctx)

  with pytest.raises(
    pe.AsyncEmbStateError,
    match=r"gradient_update_done on table 't'.*no armed update_start.*call gradient_update_start",
  ):
    done_without_start()

  @wrap
  def two_starts(table, opt_state, update):
    _, table, opt_state, _ = pe.gradient_update_start(ctx, update, table, opt_state)
    return pe.gradient_update_start(ctx, update, table, opt_state)

  with pytest.raises(
    pe.AsyncEmbStateError,
    match=r"gradient_update_start on table 't'.*update start before the pending update done"
    r".*gradient_update_done",
  ):
    two_starts(state["t"].table, opt_state, update)
  ctx.reset()
  # Eagerly the first start donated the table; start again from a fresh one.
  state = emb.init(jax.random.key(0))
  opt_state = pe.EmbOptState(state["t"].slots, state["t"].step)

  @wrap
  def lookup_in_flight(table, opt_state, update, ids):
    _, table, opt_state, _ = pe.gradient_update_start(ctx, update, table, opt_state)
    return pe.lookup_start(ctx, table, ids)

  with pytest.raises(
    pe.AsyncEmbStateError,
    match=r"lookup_start on table 't'.*while its gradient update is in flight"
    r".*gradient_update_done",
  ):
    lookup_in_flight(state["t"].table, opt_state, update, _batches(1)[0]["ids"])
  ctx.reset()
  assert not ctx.in_flight


def test_reusing_a_donated_table_is_a_clear_error():
  emb = _emb(8)
  ctx = _ctx(emb)
  state = emb.init(jax.random.key(0))
  _, update, opt_state = _start_args(emb, ctx, state)
  pe.gradient_update_start(ctx, update, state["t"].table, opt_state)
  pe.gradient_update_done(ctx)
  with pytest.raises(pe.InputError, match=r"table 't' \(or a slot\) was donated"):
    pe.lookup_start(ctx, state["t"].table, _batches(1)[0]["ids"])


def test_start_and_done_in_different_traces_is_refused():
  emb = _emb(8)
  ctx = _ctx(emb)
  state = emb.init(jax.random.key(0))
  _, update, opt_state = _start_args(emb, ctx, state)
  out = jax.jit(lambda t, o, u: pe.gradient_update_start(ctx, u, t, o)[1])(
    state["t"].table, opt_state, update
  )
  del out
  with pytest.raises(pe.AsyncEmbStateError, match="another trace"):
    pe.gradient_update_done(ctx)
  ctx.reset()


def test_eager_start_done_applies_and_reports():
  emb = _emb(8, pe.SGD(1.0))
  ctx = _ctx(emb)
  state = emb.init(jax.random.key(0))
  before = emb.logical_table(state, "t")
  lookup, update, opt_state = _start_args(emb, ctx, state)
  pins, table, opt_state, m = pe.gradient_update_start(ctx, update, state["t"].table, opt_state)
  assert ctx.in_flight
  norm, valid, pin = pe.gradient_update_done(ctx, gate=m["grad_norm"])
  assert bool(valid) and float(norm) > 0 and int(pin) == 1 and not ctx.in_flight
  assert set(m) == {
    "unique_ids",
    "invalid_ids",
    "overflow_ids",
    "grad_norm",
    "applied",
    "max_unique_per_shard",
    "max_ids_per_route",
    "max_rows_per_owner",
  }
  after = emb.logical_table({"t": pe.TableState(table, opt_state.slots, opt_state.step)}, "t")
  assert (after != before).any()
  # The empty update applies nothing.
  empty = pe.empty_gradient_update(ctx)
  _, table2, _, m2 = pe.gradient_update_start(ctx, empty, table, opt_state)
  _, valid2, _ = pe.gradient_update_done(ctx)
  assert not bool(valid2) and not bool(m2["applied"])
  np.testing.assert_array_equal(emb.logical_table({"t": pe.TableState(table2, {}, 0)}, "t"), after)


# -- pipelines ----------------------------------------------------------------


def _loss_fn(params, acts, batch):
  # A linear model: logit = <emb, w> * scale + bias. Plain enough that the
  # pipelines' float results do not depend on how XLA fuses the step.
  logit = jnp.sum(acts["f"] * batch["w"], axis=1) * params["scale"] + params["bias"]
  loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logit, batch["y"]))
  return loss, {"logit": logit}


def _trainer(emb, config):
  return pe.make_trainer(emb, _loss_fn, optax.sgd(0.1), config, _batches(1)[0])


PARAMS = {"scale": jnp.float32(1.0), "bias": jnp.float32(0.0)}


def _run_pipeline(emb, config, batches):
  tr = _trainer(emb, config)
  state = tr.init(PARAMS, emb.init(jax.random.key(0)), batches[0])
  metrics = []
  for t in range(len(batches)):
    state, m = tr.step(state, batches[t], batches[min(t + 1, len(batches) - 1)])
    metrics.append(jax.device_get(m))
  state, _ = tr.flush(state)
  return emb.logical_table(state.tables, "t"), jax.device_get(state.params), metrics


def _run_sync_reference(emb, batches, stale):
  """Plain synchronous loop; with `stale`, it looks up from the table as it
  was one step earlier."""
  tables = emb.init(jax.random.key(0))
  prev = jax.tree.map(jnp.copy, tables)
  params, opt = PARAMS, optax.sgd(0.1)
  opt_state = opt.init(params)
  # Jitted, as the Trainer's dense step is (see test_trainer_vocab's
  # reference: eager dispatch on the mesh aborted a worker now and then).
  grads = jax.jit(jax.value_and_grad(_loss_fn, argnums=(0, 1), has_aux=True))
  for batch in batches:
    acts, res = emb.lookup(prev if stale else tables, batch["ids"])
    (loss, _), (g_p, g_a) = grads(params, acts, batch)
    upd, opt_state = opt.update(g_p, opt_state, params)
    params = optax.apply_updates(params, upd)
    prev = jax.tree.map(jnp.copy, tables)
    tables, _ = emb.apply_gradients(tables, res, g_a)
  return emb.logical_table(tables, "t"), jax.device_get(params)


# The quick loop's subset (conftest): the 8-device Explicit mesh.
QUICK = {"test_async_pipeline_equals_sync_loop_one_step_stale": lambda p: p["kind"] == "explicit"}


@pytest.mark.parametrize("num_devices,kind", [(1, "auto"), (8, "auto"), (8, "explicit")])
def test_async_pipeline_equals_sync_loop_one_step_stale(num_devices, kind):
  emb = _emb(num_devices, kind=kind)
  batches = _batches(5)
  table, params, _ = _run_pipeline(emb, pe.TrainConfig(use_async_emb=True), batches)
  ref_table, ref_params = _run_sync_reference(emb, batches, stale=True)
  np.testing.assert_allclose(table, ref_table, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(params["scale"], ref_params["scale"], rtol=1e-6)
  # ... and differs from unstaled training: the staleness is real.
  fresh, _ = _run_sync_reference(emb, batches, stale=False)
  assert np.abs(fresh - table).max() > 1e-4


def test_a_replicated_table_trains_in_the_async_pipeline_one_step_stale():
  """Its first step applies the empty update of a table stored whole on
  every device (`replicated_ops.empty_shard`)."""
  emb = _emb(8, placement="replicated")
  batches = _batches(4)
  table, _, _ = _run_pipeline(emb, pe.TrainConfig(use_async_emb=True), batches)
  ref_table, _ = _run_sync_reference(emb, batches, stale=True)
  np.testing.assert_allclose(table, ref_table, rtol=1e-6, atol=1e-7)
  assert np.abs(table - np.asarray(emb.logical_table(emb.init(jax.random.key(0)), "t"))).max() > 0


@pytest.mark.parametrize("num_devices", [1, 8])
def test_exact_pipeline_equals_plain_synchronous_training(num_devices):
  emb = _emb(num_devices)
  batches = _batches(5)
  table, params, _ = _run_pipeline(emb, pe.TrainConfig(use_async_emb=True, exact=True), batches)
  sync_table, sync_params, _ = _run_pipeline(emb, pe.TrainConfig(use_async_emb=False), batches)
  ref_table, ref_params = _run_sync_reference(emb, batches, stale=False)
  np.testing.assert_allclose(table, ref_table, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(sync_table, ref_table, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(params["bias"], ref_params["bias"], rtol=1e-6, atol=1e-7)


def test_nan_gradient_skips_that_update_and_training_proceeds():
  emb = _emb(8, pe.SGD(0.5))

  def loss_fn(params, acts, batch):
    loss, aux = _loss_fn(params, acts, batch)
    # NaN in the embedding gradient only (the dense gradient stays finite).
    return loss + jnp.sum(acts["f"]) * batch["nan"], aux

  batches = _batches(5, nan_at=2)
  tr = pe.make_trainer(emb, loss_fn, optax.sgd(0.1), pe.TrainConfig(), batches[0])
  state = tr.init(PARAMS, emb.init(jax.random.key(0)), batches[0])
  applied, skipped, tables = [], [], []
  for t in range(5):
    tables.append(np.asarray(state.tables["t"].table).copy())
    state, m = tr.step(state, batches[t], batches[min(t + 1, 4)])
    applied.append(bool(m["emb"]["t"]["applied"]))
    skipped.append(bool(m["emb"]["t"]["skipped"]))
    assert np.isfinite(float(state.params["bias"]))  # the dense update is not skipped
  # Step t applies step t-1's gradient: step 0 applies the empty update,
  # step 3 would apply step 2's NaN gradient and skips it.
  assert applied == [False, True, True, False, True]
  assert skipped == [False, False, False, True, False]
  # The skipped step (3) left the table bit-for-bit unchanged; tables[t] is
  # the table before step t.
  np.testing.assert_array_equal(tables[4], tables[3])
  assert (tables[3] != tables[2]).any()
  assert np.isfinite(np.asarray(state.tables["t"].table)).all()


def test_jitted_step_donates_table_and_slots():
  emb = _emb(8)
  batches = _batches(2)
  tr = _trainer(emb, pe.TrainConfig())
  state = tr.init(PARAMS, emb.init(jax.random.key(0)), batches[0])
  old = state.tables["t"]
  state, _ = tr.step(state, batches[0], batches[1])
  assert old.table.is_deleted() and old.slots["acc"].is_deleted()
  from pallas_emb.train.step import _jit_step

  hlo = _jit_step.lower(tr, state, batches[0], batches[1]).compile().as_text()
  # The table and slot parameters are aliased to outputs: updated in place.
  assert "input_output_alias" in hlo and hlo.count("may-alias") + hlo.count("must-alias") >= 2


def test_the_sync_step_ignores_next_batch_and_compiles_once():
  from pallas_emb.train.step import _jit_step

  emb = _emb(8)
  batches = _batches(3)
  tr = _trainer(emb, pe.TrainConfig(use_async_emb=False))
  compiled = _jit_step._cache_size()
  misplaced = jax.device_put(batches[1], jax.devices()[0])  # off the mesh: never checked
  tables = []
  for following in (None, batches[1], {"ids": {"f": np.zeros((2, 7), np.int64)}}, misplaced):
    state = tr.init(PARAMS, emb.init(jax.random.key(0)), batches[0])
    for t in range(2):
      state, _ = tr.step(state, batches[t], following)
    tables.append(emb.logical_table(state.tables, "t"))
  for t in tables[1:]:
    np.testing.assert_array_equal(t, tables[0])
  assert _jit_step._cache_size() - compiled == 1


def test_flush_does_not_change_the_trajectory():
  from pallas_emb.train.step import _jit_step

  emb = _emb(8)
  batches = _batches(4)
  tr = _trainer(emb, pe.TrainConfig())
  compiled = _jit_step._cache_size()
  runs = []
  for flush_at in (None, 1):
    state = tr.init(PARAMS, emb.init(jax.random.key(0)), batches[0])
    for t in range(4):
      state, _ = tr.step(state, batches[t], batches[min(t + 1, 3)])
      if t == flush_at:
        state, _ = tr.flush(state)
    state, _ = tr.flush(state)
    runs.append(emb.logical_table(state.tables, "t"))
  np.testing.assert_array_equal(runs[0], runs[1])
  # One program for every step: the first step's empty pending update (and
  # a flush's) has the type a step's own has (a step compiled twice cost
  # 10 s per run on a v5e chip).
  assert _jit_step._cache_size() - compiled <= 1


def test_evaluate_reuses_the_lookup_programs_that_init_compiled():
  """`Trainer.evaluate` runs each table's lookup program, which the async
  `init` compiled for the training batch: an evaluation at that shape
  compiles only the loss, and gives the bits of one program of lookup and
  loss (DLRM on CPU: 9.8 s of compile at the end of each run before)."""
  from pallas_emb import programs
  from pallas_emb.train.step import _jit_loss

  emb = _emb(8)
  batches = _batches(3)
  tr = _trainer(emb, pe.TrainConfig())
  state = tr.init(PARAMS, emb.init(jax.random.key(0)), batches[0])
  state, _ = tr.step(state, batches[0], batches[1])
  state, _ = tr.flush(state)
  lookups, losses = programs.lookup._cache_size(), _jit_loss._cache_size()
  loss, aux = tr.evaluate(state, batches[2])
  assert programs.lookup._cache_size() == lookups
  assert _jit_loss._cache_size() == losses + 1

  @jax.jit
  def one_program(tables, batch):
    acts, _ = emb.lookup(tables, batch["ids"])
    return _loss_fn(state.params, acts, batch)

  want_loss, want_aux = one_program(state.tables, batches[2])
  np.testing.assert_array_equal(loss, want_loss)
  np.testing.assert_array_equal(aux["logit"], want_aux["logit"])
