"""Ratings files: the GroupLens releases' three formats and RecBole's `.inter`.

* `u.data` (ML-100K): `user item rating timestamp`, tab-separated;
* `ratings.dat` (ML-1M, ML-10M): `user::item::rating::timestamp`;
* `ratings.csv` (ML-20M, ML-25M, latest): `userId,movieId,rating,timestamp`
  under a header line;
* `*.inter` (RecBole's atomic files, e.g. `ml-100k.inter` of the recbole
  wheel, see `pallas_emb.data.fetch_movielens`): tab-separated under a header
  of typed names (`user_id:token item_id:token rating:float
  timestamp:float`). Its columns are found by name, in any order; other
  columns are ignored.

Ids are integers end to end (never parsed through a float, so ids at or above
2**53 stay distinct).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import numpy as np

from pallas_emb.data.base import DataError

FORMATS = "u.data, ratings.dat, ratings.csv or a RecBole .inter file"
_FIELDS = ("user", "item", "rating", "timestamp")
# Header names (lower case, a .inter name without its ":type") of each field.
_NAMES = {
  "user": ("user_id", "userid"),
  "item": ("item_id", "itemid", "movieid", "movie_id"),
  "rating": ("rating",),
  "timestamp": ("timestamp",),
}


class Ratings(NamedTuple):
  """A ratings file, one entry per rating line, in file order.

  Attributes:
    user, item: (N,) raw ids: int64, or Python ints (dtype object) when one
      does not fit int64.
    rating: (N,) float64, all finite.
    timestamp: (N,) int64 seconds since the epoch.
  """

  user: np.ndarray
  item: np.ndarray
  rating: np.ndarray
  timestamp: np.ndarray


class _Layout(NamedTuple):
  """How a file's lines split, and where each field is."""

  sep: str | None  # None: any whitespace
  columns: tuple[int, int, int, int]  # user, item, rating, timestamp
  width: int  # fields per line


_FIXED = _Layout(None, (0, 1, 2, 3), 4)
_INT64 = np.iinfo(np.int64)


def _header_layout(line: str, sep: str, path: str) -> _Layout:
  """The layout a header line names (`.inter`: `name:type` fields)."""
  names = [f.strip().split(":")[0].lower() for f in line.rstrip("\r\n").split(sep)]
  columns = []
  for field in _FIELDS:
    found = [i for i, n in enumerate(names) if n in _NAMES[field]]
    if len(found) != 1:
      raise DataError(
        f"{path}:1: the header {line.strip()[:120]!r} has {len(found)} {field} columns "
        f"(one of {', '.join(_NAMES[field])}); a ratings file needs exactly one of each of "
        "user, item, rating and timestamp."
      )
    columns.append(found[0])
  return _Layout(sep, tuple(columns), len(names))


def _parse_line(line: str, layout: _Layout, where: str):
  fields = line.split(layout.sep) if layout.sep else line.split()
  if len(fields) != layout.width:
    raise DataError(
      f"{where}: expected {layout.width} fields"
      f"{' (user, item, rating, timestamp)' if layout.width == 4 else ''}, "
      f"got {len(fields)}: {line.strip()[:80]!r}"
    )
  u, i, r, t = (fields[c].strip() for c in layout.columns)
  try:
    user, item = int(u), int(i)
    rating = float(r)
  except ValueError as e:
    raise DataError(
      f"{where}: cannot parse {line.strip()[:80]!r} as integer user and "
      f"item ids and a numeric rating ({e})."
    ) from None
  if not math.isfinite(rating):
    raise DataError(f"{where}: rating {r!r} is not a finite number; fix or drop the line.")
  return user, item, rating, _timestamp(t, where)


def _timestamp(text: str, where: str) -> int:
  """Seconds since the epoch, an integer (written as one, or as a float
  with no fraction) that fits int64."""
  try:
    value = int(text)
  except ValueError:
    try:
      number = float(text)
    except ValueError:
      raise DataError(
        f"{where}: timestamp {text!r} is not a number; it must be integer seconds since the epoch."
      ) from None
    if not math.isfinite(number) or number != int(number):
      raise DataError(
        f"{where}: timestamp {text!r} is not an integer number of seconds since the epoch; "
        "fix or drop the line."
      ) from None
    value = int(number)
  if not _INT64.min <= value <= _INT64.max:
    raise DataError(
      f"{where}: timestamp {text!r} does not fit int64 seconds; fix or drop the line."
    )
  return value


def _id_array(ids: list[int]) -> np.ndarray:
  """Raw ids as int64, or as exact Python ints when one does not fit."""
  if all(_INT64.min <= i <= _INT64.max for i in ids):
    return np.array(ids, np.int64)
  return np.array(ids, dtype=object)


def _first_layout(name: str, first: str, path: str) -> tuple[_Layout, bool]:
  """(layout, whether the first line is a header) of a file by its name."""
  if name.endswith(".inter"):
    return _header_layout(first, "\t", path), True
  if name.endswith(".csv"):
    if first.split(",")[0].strip().lstrip("-").isdigit():
      return _FIXED._replace(sep=","), False  # no header: the release's order
    return _header_layout(first, ",", path), True
  if name.endswith(".dat"):
    return _FIXED._replace(sep="::"), False
  return _FIXED, False  # u.data: tabs (any whitespace)


def load_ratings(path: str) -> Ratings:
  """Reads a ratings file: u.data, ratings.dat, ratings.csv or `*.inter`.

  Raises:
    DataError: the file is missing or empty, its header lacks a field, or a
      line is malformed or holds a non-finite rating or timestamp (the
      message names the path and the line number).
  """
  if not os.path.isfile(path):
    raise DataError(
      f"MovieLens ratings file {path!r} does not exist; pass --data=movielens:PATH to {FORMATS} "
      "(python -m pallas_emb.data.fetch_movielens DIR fetches ml-100k.inter)."
    )
  name = os.path.basename(path)
  rows, layout = [], None
  with open(path, encoding="utf-8", errors="replace") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      if layout is None:
        layout, header = _first_layout(name, line, path)
        if header:
          continue
      rows.append(_parse_line(line, layout, f"{path}:{lineno}"))
  if not rows:
    raise DataError(f"MovieLens ratings file {path!r} holds no ratings.")
  user, item, rating, timestamp = zip(*rows)
  return Ratings(
    _id_array(list(user)),
    _id_array(list(item)),
    np.array(rating, np.float64),
    np.array(timestamp, np.int64),
  )
