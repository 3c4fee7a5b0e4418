"""The per-device token order (`pallas_emb.tokens`): position-major blocks,
`Factored` gradients written in one pass, and the global reorderings."""

import jax.numpy as jnp
import numpy as np

from pallas_emb import tokens


def _position_major(block: np.ndarray) -> np.ndarray:
  """(b, L, ...) -> (L * b, ...), token l * b + e = example e's l-th."""
  return np.swapaxes(block, 0, 1).reshape((-1,) + block.shape[2:])


def test_ids_flatten_position_major():
  ids = np.arange(12, dtype=np.int32).reshape(3, 4)  # b = 3 examples, L = 4
  got = np.asarray(tokens.flatten(jnp.asarray(ids)))
  np.testing.assert_array_equal(got, [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11])


def test_factored_runs_equal_their_dense_blocks_in_token_order():
  rng = np.random.default_rng(0)
  b, c, d = 8, 5, 3
  # Two runs of b = 8 (with a dense sequence block in the second), one of
  # b = 5 (ragged-like): every mix concat_tokens meets.
  rows = [rng.standard_normal((n, d)).astype(np.float32) for n in (b, b, c, b, b)]
  weights = [
    rng.standard_normal((l, n)).astype(np.float32) for l, n in ((1, b), (3, b), (1, c), (2, b))
  ]
  sequence = rng.standard_normal((4, b, d)).astype(np.float32)
  blocks = [
    tokens.Factored(jnp.asarray(rows[0]), jnp.asarray(weights[0])),
    tokens.Factored(jnp.asarray(rows[1]), jnp.asarray(weights[1])),
    tokens.Factored(jnp.asarray(rows[2]), jnp.asarray(weights[2])),
    tokens.Factored(jnp.asarray(rows[3]), jnp.asarray(weights[3])),
    jnp.asarray(sequence),
  ]
  # Per feature, the (b, L, D) gradient a token-major reader expects.
  per_example = [
    rows[0][:, None] * weights[0].T[..., None],
    rows[1][:, None] * weights[1].T[..., None],
    rows[2][:, None] * weights[2].T[..., None],
    rows[3][:, None] * weights[3].T[..., None],
    np.swapaxes(sequence, 0, 1),
  ]
  want = np.concatenate([_position_major(x) for x in per_example])
  got = np.asarray(tokens.concat_tokens(blocks))
  np.testing.assert_array_equal(got, want)


def test_split_inverts_concat():
  rng = np.random.default_rng(1)
  shapes = [(8, 1), (8, 3), (5, 1), (8, 2)]  # (b, L) per feature
  blocks = [rng.standard_normal((l, b, 2)).astype(np.float32) for b, l in shapes]
  joined = tokens.concat_tokens([jnp.asarray(x) for x in blocks])
  for got, want in zip(tokens.split_tokens(joined, shapes), blocks):
    np.testing.assert_array_equal(np.asarray(got), want)


def test_device_order_round_trips_and_keeps_each_device_position_major():
  rng = np.random.default_rng(2)
  s, names = 2, ("a", "h")
  per_feature = {"a": rng.integers(0, 99, (4, 1)), "h": rng.integers(0, 99, (4, 3))}
  flat = np.asarray(tokens.to_device_order(per_feature, names, s))
  # Device 0 holds examples 0-1: feature a's two ids, then h position-major.
  h0 = per_feature["h"][:2]
  np.testing.assert_array_equal(flat[:8], np.concatenate([per_feature["a"][:2, 0], h0.T.ravel()]))
  back = tokens.from_device_order(jnp.asarray(flat), names, [(4, 1), (4, 3)], s)
  for n in names:
    np.testing.assert_array_equal(np.asarray(back[n]), per_feature[n])
