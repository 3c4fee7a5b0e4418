"""Flax NNX front end: the sharded tables as an NNX module.

The only part of pallas_emb that imports flax (the `flax` extra).

    embed = Embed(emb, key=k, config=pe.TrainConfig(), first_ids=b0["ids"])
    dense = RankingMLP(model, k2)            # any module: (acts, batch) -> (loss, aux),
                                             # e.g. pallas_emb.job.nnx_model's
    opt = nnx.Optimizer(dense, optax.adam(1e-3), wrt=nnx.Param)
    metrics = train_step(embed, dense, opt, batch, next_batch)
"""

from pallas_emb.nnx.embed import Embed, EmbNextLookup, EmbPending, EmbSlots, EmbStep, EmbTable
from pallas_emb.nnx.step import evaluate, flush, replicate, train_step

__all__ = [
  "Embed",
  "EmbNextLookup",
  "EmbPending",
  "EmbSlots",
  "EmbStep",
  "EmbTable",
  "evaluate",
  "flush",
  "replicate",
  "train_step",
]
