"""Click-log data for the main job: a synthetic generator and MovieLens."""

from pallas_emb.data.base import DataError, Dataset, FeatureInfo
from pallas_emb.data.movielens import MovieLens, load_ratings
from pallas_emb.data.synthetic import SyntheticClickLog

__all__ = [
  "DataError",
  "Dataset",
  "FeatureInfo",
  "MovieLens",
  "SyntheticClickLog",
  "load_ratings",
  "from_flag",
]


def from_flag(spec: str, seed: int = 0, history_len: int = 16) -> Dataset:
  """`--data` value -> dataset: "synthetic" or "movielens:PATH" (whose
  history bag holds at most `history_len` items; 0: none)."""
  if spec == "synthetic":
    return SyntheticClickLog(seed=seed)
  if spec.startswith("movielens:"):
    return MovieLens.from_file(spec[len("movielens:") :], seed=seed, history_len=history_len)
  raise DataError(
    f"--data={spec!r} is not a known source; use 'synthetic' or "
    "'movielens:PATH' (u.data, ratings.dat or ratings.csv)."
  )
