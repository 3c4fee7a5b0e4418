"""`python -m pallas_emb.verify DIR`: is every checkpoint step in DIR intact?

Reads each step back whole, newest first, as host arrays (no accelerator is
touched: this runs beside a training job), and checks the digest of its
metadata and the checksum of every array, the pending update included. One
line per step, then the step a resume would restore:

    /tmp/run: 3 checkpoint steps
    step 30: NOT INTACT: array 'tables/user/table' reads back with checksum ...
    step 20: intact (41 arrays)
    step 10: intact (41 arrays)
    newest intact step: 20 (--resume restores it, skipping 30)

Exit status: 0 when every step is intact, 1 when one is not or there is no
step, 2 for a directory that does not exist.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  # Before JAX is imported: a verification must not claim the accelerators
  # of a job that is training.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
from typing import NamedTuple  # noqa: E402

from pallas_emb.train.checkpoint_dir import CheckpointDir, StepUnreadable  # noqa: E402


class StepReport(NamedTuple):
  """The verdict on one step: intact or not, and what was found."""

  step: int
  intact: bool
  detail: str


def verify_directory(directory: str) -> list[StepReport]:
  """Checks every step in `directory`, newest first (see the module doc)."""
  ckpt = CheckpointDir(directory, writable=False)
  reports = []
  for step in ckpt.steps():
    try:
      _, arrays = ckpt.verify(step)
    except StepUnreadable as e:
      reports.append(StepReport(step, False, str(e)))
      continue
    reports.append(StepReport(step, True, f"{arrays} arrays"))
  return reports


def summary(reports: list[StepReport]) -> str:
  """The last line: the step a resume restores, and what it skips."""
  intact = [r.step for r in reports if r.intact]
  if not intact:
    return "no intact step: --resume fails with CheckpointCorruptError"
  skipped = [str(r.step) for r in reports if r.step > intact[0]]
  skips = f", skipping {', '.join(skipped)}" if skipped else ""
  return f"newest intact step: {intact[0]} (--resume restores it{skips})"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m pallas_emb.verify",
    description="Check that every checkpoint step in a directory reads back intact.",
  )
  parser.add_argument("directory", help="a --checkpoint_dir of the main job")
  args = parser.parse_args(argv)
  if not os.path.isdir(args.directory):
    print(f"{args.directory}: not a directory", file=sys.stderr)
    return 2
  reports = verify_directory(args.directory)
  print(f"{os.path.abspath(args.directory)}: {len(reports)} checkpoint steps")
  for r in reports:
    print(
      f"step {r.step}: {'intact' if r.intact else 'NOT INTACT'}"
      f"{' (' + r.detail + ')' if r.intact else ': ' + r.detail}"
    )
  print(summary(reports))
  return 0 if reports and all(r.intact for r in reports) else 1


if __name__ == "__main__":
  sys.exit(main())
