"""Click-log data for the main job: a synthetic generator and MovieLens."""

from pallas_emb.data.base import DataError, Dataset, FeatureInfo
from pallas_emb.data.movielens import MovieLens
from pallas_emb.data.ratings_file import FORMATS, load_ratings
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


def from_flag(
  spec: str, seed: int = 0, history_len: int = 50, validation_fraction: float = 0.0
) -> Dataset:
  """`--data` value -> dataset: "synthetic" or "movielens:PATH" (whose
  history bag holds at most `history_len` ratings, 0: none; with
  `validation_fraction` > 0 it evaluates on its validation window,
  `MovieLens.from_file`)."""
  if spec == "synthetic":
    return SyntheticClickLog(seed=seed)
  if spec.startswith("movielens:"):
    return MovieLens.from_file(
      spec[len("movielens:") :],
      seed=seed,
      history_len=history_len,
      validation_fraction=validation_fraction,
    )
  raise DataError(
    f"--data={spec!r} is not a known source; use 'synthetic' or 'movielens:PATH' ({FORMATS})."
  )
