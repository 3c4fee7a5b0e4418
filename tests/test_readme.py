"""Every code block of README.md runs, so the guide cannot rot.

Python blocks run in a fresh interpreter each. Shell blocks run with their
leading `pip install ... &&` dropped (the package is installed already); the
test command's block is this suite itself and is run by .ci/run, not here.
"""

import os
import re
import subprocess
import sys

import pytest
from conftest import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(REPO, "README.md")).read()
BLOCK = re.compile(r"(<!-- ci:(\w+) -->\n)?```(python|bash)\n(.*?)```", re.S)
BLOCKS = [(m.group(2), m.group(3), m.group(4)) for m in BLOCK.finditer(README)]


def _env(lang: str, code: str) -> dict[str, str]:
  env = child_env()
  if lang == "python":
    # The Python blocks ask for their devices with os.environ.setdefault, as
    # a user would; the command-line programs add a count to XLA_FLAGS. A
    # block gets the flags it asks for, and the suite's compile flags beside.
    asked = re.search(r'os\.environ\.setdefault\("XLA_FLAGS", "([^"]*)"\)', code)
    if asked:
      env["XLA_FLAGS"] = f"{asked.group(1)} {env['XLA_FLAGS']}"
  return env


def test_readme_has_the_two_commands():
  markers = {marker: code for marker, _, code in BLOCKS if marker}
  assert markers["main"].strip() == "pip install . && python -m pallas_emb"
  assert markers["test"].strip() == (
    'pip install ".[test]" && python -m pytest -q -n auto --maxprocesses=4 --dist=loadfile '
    "--durations=15"
  )


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i, (m, _, _) in enumerate(BLOCKS) if m != "test"])
def test_readme_block_runs(index, tmp_path):
  marker, lang, code = BLOCKS[index]
  if lang == "python":
    cmd = [sys.executable, "-c", code]
  else:
    script = re.sub(r"^pip install [^&\n]*&&\s*", "", code, flags=re.M)
    cmd = ["bash", "-euo", "pipefail", "-c", script.replace("python ", f"{sys.executable} ")]
  proc = subprocess.run(
    ["timeout", "-k", "5", "420", *cmd],
    cwd=tmp_path,
    env=_env(lang, code),
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 0, (
    f"README block {index} ({lang}):\n{code}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
  )
  if marker == "main":
    assert "final: step 500" in proc.stdout and "eval auc" in proc.stdout
