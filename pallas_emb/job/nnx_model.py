"""The main job's ranking model (`pallas_emb.job.model`) as NNX modules."""

from __future__ import annotations

import jax
from flax import nnx

from pallas_emb.job.model import RankingModel


class DenseLayer(nnx.Module):
  """One (in, out) weight and (out,) bias, as `nnx.Param`s."""

  def __init__(self, w: jax.Array, b: jax.Array):
    self.w, self.b = nnx.Param(w), nnx.Param(b)


class RankingMLP(nnx.Module):
  """`RankingModel`'s MLP with its parameters as NNX state.

  `__call__(acts, batch)` is `RankingModel.loss` on those parameters (the
  same function: the NNX and functional models compute alike).

  Args:
    model: the `RankingModel` (features, sizes).
    key: initialises the layers as `model.init(key)`.
  """

  def __init__(self, model: RankingModel, key: jax.Array):
    self.model = model
    self.layers = nnx.List([DenseLayer(p["w"], p["b"]) for p in model.init(key)])

  def params(self) -> list[dict[str, jax.Array]]:
    """The layers as `RankingModel` parameters: [{"w", "b"}, ...]."""
    return [{"w": l.w[...], "b": l.b[...]} for l in self.layers]

  def __call__(self, acts, batch):
    """(weighted mean log-loss, {"logits": (B,)}) of feature -> (B, dim)
    embeddings and the batch's "dense", "label", "weight"."""
    return self.model.loss(self.params(), acts, batch)
