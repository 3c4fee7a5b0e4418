"""The tree is formatted and linted as pyproject.toml configures (ruff), and
the package keeps its house: no import circle, no module over 400 lines."""

import ast
import pathlib
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
  ruff = shutil.which("ruff")
  assert ruff, "ruff is not installed: pip install '.[test]'"
  return subprocess.run([ruff, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")])
def test_ruff_is_clean(args):
  proc = _ruff(*args)
  assert proc.returncode == 0, f"ruff {' '.join(args)}:\n{proc.stdout}{proc.stderr}"


def test_no_module_is_over_400_lines():
  long = {
    str(p.relative_to(REPO)): n
    for p in (REPO / "pallas_emb").rglob("*.py")
    if (n := len(p.read_text().splitlines())) > 400
  }
  assert not long, f"split these modules: {long}"


def test_the_library_never_imports_the_job_or_the_benchmarks():
  """The top of pallas_emb is the library: only the job, the benchmarks and
  pod_check (above it) may import `pallas_emb.job` or `pallas_emb.bench`."""
  above = {"job", "bench", "pod_check", "__main__.py"}
  offenders = []
  for path in (REPO / "pallas_emb").rglob("*.py"):
    if path.relative_to(REPO / "pallas_emb").parts[0] in above:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      names = (
        [node.module or ""]
        if isinstance(node, ast.ImportFrom)
        else [a.name for a in node.names]
        if isinstance(node, ast.Import)
        else []
      )
      offenders += [
        f"{path.relative_to(REPO)} imports {n}"
        for n in names
        if n.startswith(("pallas_emb.job", "pallas_emb.bench"))
      ]
  assert not offenders, offenders


def _module_exists(name: str) -> bool:
  path = REPO.joinpath(*name.split("."))
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_import_of_the_project_names_a_module_that_exists():
  """Also imports inside functions, which only run late (a moved module)."""
  import pallas_emb

  exported = set(pallas_emb._EXPORTS)
  missing = []
  for path in [
    *REPO.glob("pallas_emb/**/*.py"),
    *REPO.glob("sharding/*.py"),
    *REPO.glob("tests/*.py"),
  ]:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and not node.level and node.module:
        if node.module.split(".")[0] not in ("pallas_emb", "sharding"):
          continue
        if not _module_exists(node.module):
          missing.append(f"{path.relative_to(REPO)}: {node.module}")
        elif node.module == "pallas_emb":
          missing += [
            f"{path.relative_to(REPO)}: pallas_emb.{a.name}"
            for a in node.names
            if a.name not in exported and not _module_exists(f"pallas_emb.{a.name}")
          ]
      elif isinstance(node, ast.Import):
        missing += [
          f"{path.relative_to(REPO)}: {a.name}"
          for a in node.names
          if a.name.split(".")[0] in ("pallas_emb", "sharding") and not _module_exists(a.name)
        ]
  assert not missing, missing
