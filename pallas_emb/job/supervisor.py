"""One process of a multi-process job, run under a supervisor that reports a
lost peer by name, with the step to resume from.

When a process dies, JAX's coordination service notices within about a
second (its connection closes), or after --heartbeat_timeout seconds when it
hangs, and then stops every other process with a fatal error in C++
(`abort`) that Python cannot intercept. jaxlib 0.10.2 has a hook for it
(`missed_heartbeat_callback` of the runtime client), but
`jax.distributed.initialize` does not pass one, and a Python callback there
dies converting its `absl::Status` argument (`std::bad_cast`).

So `python -m pallas_emb` with several processes runs the job in a child
process, the worker, and stays as its supervisor (it imports nothing heavy):
it echoes the worker's stderr, and when the coordination service stopped the
worker, it says which process was lost and the newest checkpoint step in
--checkpoint_dir, then exits with `EXIT_PEER_LOST`. Any other exit of the
worker is passed through, but for one case: a collective (gloo, over TCP)
that broke off because its peer died aborts the worker, often before the
coordination service has declared the peer lost; that is a lost peer too.

The step is read from the directory, not from the worker: a process lost
during a save stops the others inside that save, after the step was
committed (orbax renames a step into place only when it is complete) but
before the save returned.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: restart every process with --resume.

_WORKER_ENV = "PALLAS_EMB_SUPERVISED"
# What the coordination service's client logs before it aborts a process.
_FATAL = "Terminating process because the JAX distributed service detected fatal errors"
_UNHEALTHY = "tasks are unhealthy"
_LEADER_GONE = "Failed to send RPC to coordination service"
# What a cross-process collective (gloo, over TCP) logs when its peer died
# during it. The worker aborts on it, often before the coordination service
# has noticed the loss, so it is a lost peer too; gloo does not say which.
_COLLECTIVE_BROKEN = (
  "Connection closed by peer",
  "Received data size doesn't match expected size",
  "gloo/transport/tcp",
)


def _flag(argv: list[str], name: str, env: str | None = None) -> str | None:
  """The value of --name in `argv` (the last one, as absl takes), or $env."""
  value = os.environ.get(env) if env else None
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      value = arg.split("=", 1)[1]
    elif arg == f"--{name}" and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def _int_flag(argv: list[str], name: str, env: str) -> int | None:
  value = _flag(argv, name, env)
  return int(value) if value and value.isdigit() else None


def needed(argv: list[str]) -> bool:
  """Whether this is the launch of one process of several (and not already
  the supervised worker)."""
  num = _int_flag(argv, "num_processes", "JAX_NUM_PROCESSES")
  return bool(num and num > 1) and _WORKER_ENV not in os.environ


def newest_checkpoint(directory: str | None) -> int | None:
  """The newest committed step in a checkpoint directory (orbax names a step
  directory by its number only once it is complete), or None."""
  try:
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()] if directory else []
  except OSError:
    return None
  return max(steps, default=None)


def lost_processes(log: str, peers: list[int] = ()) -> tuple[list[int], str] | None:
  """(ids, cause) of the processes the coordination service declared lost
  in a worker's stderr, or whose collective broke under the worker; None
  when neither stopped it. `peers`: the other processes' ids (the one lost
  when a collective broke with a single peer; else the ids are unknown: [])."""
  if _FATAL not in log:
    if any(s in log for s in _COLLECTIVE_BROKEN):
      return (list(peers) if len(peers) == 1 else []), "a collective with it broke off"
    return None
  if _LEADER_GONE in log:
    return [0], "the coordinator, process 0, is unreachable"
  at = log.find(_UNHEALTHY)
  ids = []
  if at >= 0:
    # "...unhealthy (stopped sending heartbeats):\n1\n2\nThe tasks have..."
    for line in log[log.find(":", at) + 1 :].lstrip("\n").splitlines():
      match = re.fullmatch(r"\s*(?:\S*task:)?(\d+)\s*", line)
      if not match:
        break
      ids.append(int(match.group(1)))
  return sorted(set(ids)), "it stopped sending heartbeats"


def _die_with_parent() -> None:
  """In the worker: die when the supervisor dies (Linux), so that killing
  one process of the job never leaves half of it running."""
  if sys.platform.startswith("linux"):
    import ctypes  # pylint: disable=g-import-not-at-top

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _report(argv: list[str], lost: list[int], cause: str) -> str:
  num = _int_flag(argv, "num_processes", "JAX_NUM_PROCESSES")
  me = _int_flag(argv, "process_id", "JAX_PROCESS_ID")
  who = (
    ("process " if len(lost) == 1 else "processes ") + ", ".join(map(str, lost))
    if lost
    else "a process"
  )
  directory = _flag(argv, "checkpoint_dir")
  step = newest_checkpoint(directory)
  if step is not None:
    resume = (
      f"Last good checkpoint: step {step} in "
      f"{os.path.abspath(directory)}; restart every process with "
      "--resume to continue from it."
    )
  else:
    resume = (
      "No checkpoint was written yet: restart every process (pass "
      "--checkpoint_dir and --checkpoint_every to resume after a loss)."
    )
  return f"pallas_emb: lost {who} of {num} ({cause}); process {me} stops too. {resume}"


def supervise(argv: list[str]) -> int:
  """Runs `python -m pallas_emb argv` as the worker -> the exit status."""
  worker = subprocess.Popen(
    [sys.executable, "-m", "pallas_emb", *argv],
    env={**os.environ, _WORKER_ENV: "1"},
    stderr=subprocess.PIPE,
    text=True,
    errors="replace",
    preexec_fn=_die_with_parent,
  )
  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda s, _: worker.send_signal(s))
  tail = collections.deque(maxlen=400)
  for line in worker.stderr:
    sys.stderr.write(line)
    sys.stderr.flush()
    tail.append(line)
  code = worker.wait()
  num = _int_flag(argv, "num_processes", "JAX_NUM_PROCESSES") or 1
  me = _int_flag(argv, "process_id", "JAX_PROCESS_ID")
  peers = [i for i in range(num) if i != me]
  lost = lost_processes("".join(tail), peers) if code else None
  if lost is None:
    return code if code >= 0 else 128 - code
  print(_report(argv, *lost), file=sys.stderr, flush=True)
  return EXIT_PEER_LOST
