"""`python -m pallas_emb`: a short demo (replaced by the main job)."""

import os
import re

_COUNT_FLAG = "--xla_force_host_platform_device_count"
if _COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_COUNT_FLAG}=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_emb as pe  # noqa: E402


def main():
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  emb = pe.ShardedEmbedding(
      [pe.TableSpec("items", 10_000, 32, optimizer=pe.RowWiseAdagrad(0.5))],
      [pe.FeatureSpec("item", "items", "sum")], mesh)
  state = emb.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  target = jnp.asarray(rng.normal(size=(32,)).astype(np.float32))

  @jax.jit
  def step(state, ids):
    acts, res = emb.lookup(state, ids)
    loss, g = jax.value_and_grad(
        lambda a: jnp.mean((a["item"] - target) ** 2))(acts)
    state, metrics = emb.apply_gradients(state, res, g)
    return state, loss, metrics

  for i in range(20):
    ids = {"item": ((rng.zipf(1.2, (256, 1)) - 1) % 10_000).astype(np.int32)}
    state, loss, m = step(state, ids)
    if i % 5 == 0 or i == 19:
      print(f"step {i:3d} loss {float(loss):.4f} unique {int(m['items'].unique_ids)}")


if __name__ == "__main__":
  main()
