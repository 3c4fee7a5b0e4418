"""Simulated CPU devices, asked for on a command line before JAX starts.

JAX reads `--xla_force_host_platform_device_count` from XLA_FLAGS once, when
it creates its CPU client, i.e. before absl has parsed any flag; so a
program reads its device-count flag from argv itself. It has no effect on
TPU or GPU, whose devices are real. Imports nothing heavy.
"""

from __future__ import annotations

import os
import re
import sys

COUNT_FLAG = "--xla_force_host_platform_device_count"


def request(flag: str, default: int, argv: list[str] | None = None) -> None:
  """Asks XLA for `--flag N` (in `argv`, default `sys.argv`) CPU devices, or
  `default`, unless XLA_FLAGS already sets a count."""
  argv = sys.argv[1:] if argv is None else argv
  match = re.search(rf"--{flag}[= ](\d+)", " ".join(argv))
  if COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    count = match.group(1) if match else default
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COUNT_FLAG}={count}".strip()
