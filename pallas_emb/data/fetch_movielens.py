"""Fetches real MovieLens-100K through the Python package registry.

    python -m pallas_emb.data.fetch_movielens DIR     # writes DIR/ml-100k.inter

GroupLens publishes ML-100K on its own site; where only the package
registry can be reached, the wheel of `recbole==1.2.1` (a zip, fetched with
`pip download --no-deps`) ships the same 100,000 ratings as RecBole's atomic
file `recbole/dataset_example/ml-100k/ml-100k.inter` (a header line, then
user, item, rating and timestamp separated by tabs), which
`pallas_emb.data.load_ratings` reads. The file is checked against its
SHA-256 before it is kept.

The data's terms (GroupLens) allow research use, ask that it be
acknowledged (F. M. Harper and J. A. Konstan, "The MovieLens Datasets:
History and Context", ACM TiiS 5(4), 2015) and forbid redistributing it:
fetch it, do not commit it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from pallas_emb.data.base import DataError

WHEEL = "recbole==1.2.1"
MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
FILENAME = "ml-100k.inter"
SHA256 = "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff"


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def fetch(directory: str) -> str:
  """DIRECTORY/ml-100k.inter, downloaded unless it is there and intact.

  Raises:
    DataError: pip could not download the wheel (its message is quoted),
      the wheel lacks the file, or the file's SHA-256 differs.
  """
  path = os.path.join(directory, FILENAME)
  if os.path.isfile(path) and _sha256(path) == SHA256:
    return path
  os.makedirs(directory, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=directory) as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if done.returncode or len(wheels) != 1:
      raise DataError(
        f"`{' '.join(cmd[2:])}` failed (exit {done.returncode}): "
        f"{(done.stderr or done.stdout).strip()[-600:]}. It needs the package index "
        "(PIP_INDEX_URL); or put ml-100k.inter (or GroupLens's u.data) in "
        f"{directory!r} by hand."
      )
    with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
      if MEMBER not in wheel.namelist():
        raise DataError(f"{wheels[0]} has no {MEMBER}; fetch {WHEEL} exactly.")
      partial = os.path.join(tmp, FILENAME)
      with wheel.open(MEMBER) as src, open(partial, "wb") as dst:
        dst.write(src.read())
    got = _sha256(partial)
    if got != SHA256:
      raise DataError(
        f"{MEMBER} of {wheels[0]} has SHA-256 {got}, not ml-100k's {SHA256}; "
        "the wheel is not the one this module knows."
      )
    os.replace(partial, path)
  return path


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print(f"usage: python -m pallas_emb.data.fetch_movielens DIR\n{__doc__}", file=sys.stderr)
    return 2
  print(fetch(argv[1]))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
