"""The documentation cannot rot: every code block of README.md and of the
site's pages (`docs/`) runs, the site builds with warnings as errors, and
the API reference has a page for every public name.

Python blocks run in a fresh interpreter each. Shell blocks run with their
leading `pip install ... &&` dropped (the package is installed already). The
test command's block is this suite itself and is run by .ci/run, not here;
a block that appears on several pages runs once.
"""

import glob
import os
import re
import subprocess
import sys

import pytest
from conftest import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
  os.path.relpath(p, REPO)
  for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)
)
BLOCK = re.compile(r"(<!-- ci:(\w+) -->\n)?```(python|bash)\n(.*?)```", re.S)


def _blocks():
  seen, out = set(), []
  for page in PAGES:
    text = open(os.path.join(REPO, page)).read()
    for m in BLOCK.finditer(text):
      marker, lang, code = m.group(2), m.group(3), m.group(4)
      if marker == "test" or "python -m pytest" in code or code in seen:
        continue
      seen.add(code)
      out.append((page, marker, lang, code))
  return out


BLOCKS = _blocks()
README = open(os.path.join(REPO, "README.md")).read()


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


def test_readme_has_the_two_commands_and_at_most_200_lines():
  markers = {m.group(2): m.group(4) for m in BLOCK.finditer(README) if m.group(2)}
  assert markers["main"].strip() == "pip install . && python -m pallas_emb"
  assert markers["test"].strip() == (
    'pip install ".[test]" && python -m pytest -q -n auto --maxprocesses=4 --dist=loadfile '
    '--durations=15 -m "not grid"'
  )
  assert len(README.splitlines()) <= 200


def test_a_worker_that_dies_fails_the_test_command_at_once(tmp_path):
  """Under the suite's hooks (`fail_fast`), a worker that aborts fails the
  run, naming the test it ran, instead of leaving pytest-xdist to wait for
  a replacement it never gives work."""
  # Without the hook this layout hangs pytest-xdist 3.8 (checked).
  tests = os.path.join(REPO, "tests")
  (tmp_path / "conftest.py").write_text(
    f"import sys\nsys.path.insert(0, {tests!r})\nfrom fail_fast import pytest_configure\n"
  )
  (tmp_path / "test_dies.py").write_text(
    "import os\n\ndef test_dies():\n  os.abort()\n\ndef test_after():\n  pass\n"
  )
  for name in ("test_lives.py", "test_lives_too.py"):
    (tmp_path / name).write_text("def test_a():\n  pass\n\ndef test_b():\n  pass\n")
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-n", "1", "--dist=loadfile", "-p", "no:cacheprovider"]
    + ["-c", os.path.join(REPO, "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=60,
    env=child_env(),
  )
  assert proc.returncode == 1, proc.stdout[-2000:]
  assert "crashed while running 'test_dies.py::test_dies'" in proc.stdout, proc.stdout[-2000:]


def test_readme_results_are_the_benchmark_json():
  import json

  from pallas_emb.bench import report

  load = lambda name: json.load(open(os.path.join(REPO, "docs", "benchmarks", name)))
  assert report.summary_table(load("forms_v5e.json"), load("w1w2.json")) in README
  assert report.drift_table(load("drift_trainer.json")) in README


def test_every_public_name_has_a_reference_page():
  import pallas_emb as pe
  from pallas_emb import nnx

  api = open(os.path.join(REPO, "docs", "api.rst")).read()
  listed = set(re.findall(r"^   (pallas_emb\.[\w.]+)$", api, re.M))
  want = {f"pallas_emb.{n}" for n in pe.__all__} | {f"pallas_emb.nnx.{n}" for n in nnx.__all__}
  assert listed == want, (want - listed, listed - want)


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path):
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "sphinx",
      "-W",
      "--keep-going",
      "-q",
      "-b",
      "html",
      "-d",
      str(tmp_path / "doctrees"),
      "docs",
      str(tmp_path / "html"),
    ],
    cwd=REPO,
    env=child_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  assert os.path.exists(tmp_path / "html" / "_autosummary" / "pallas_emb.ShardedEmbedding.html")


@pytest.mark.slow
@pytest.mark.parametrize(
  "index", range(len(BLOCKS)), ids=[f"{p}:{i}" for i, (p, *_) in enumerate(BLOCKS)]
)
def test_code_block_runs(index, tmp_path):
  page, marker, lang, code = BLOCKS[index]
  if lang == "python":
    cmd = [sys.executable, "-c", code]
  else:
    script = re.sub(r"^pip install [^&\n]*&&\s*", "", code, flags=re.M)
    cmd = ["bash", "-euo", "pipefail", "-c", script.replace("python ", f"{sys.executable} ")]
  env = _env(lang, code)
  if marker == "main":
    # As on a newcomer's machine: no platform chosen for JAX (libtpu is
    # installed here, by the test extra).
    env.pop("JAX_PLATFORMS", None)
  proc = subprocess.run(
    ["timeout", "-k", "5", "420", *cmd],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 0, (
    f"{page} block ({lang}):\n{code}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
  )
  if marker == "main":
    assert "final: step 500" in proc.stdout and "eval auc" in proc.stdout
    # A clean first run: the job's own lines, nothing from libtpu or JAX.
    own = ("pallas_emb:", "step ", "final:", "steady state", "eval at step", "baseline ")
    stray = [line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith(own)]
    assert not stray, stray[:10]
