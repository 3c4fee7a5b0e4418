"""Serving: trained tables and their id maps as a self-contained lookup.

    path = pe.export_serving(emb, tables, "/tmp/model", vocabularies=vocabs)
    served = pe.load_serving("/tmp/model")          # any process, no trainer
    acts, misses = served.lookup({"item": ids})

`export` writes the artifact (logical tables, id maps, hashing rules,
`jax.export` programs, a checksummed manifest: `artifact`); `model` loads it
(`load_serving`, `ServingModel`); `program` is the lookup that is exported
and `requests` turns a request's ids into its arguments.
"""

from pallas_emb.serving.export import export_serving
from pallas_emb.serving.model import ServingModel, load_serving

__all__ = ["ServingModel", "export_serving", "load_serving"]
