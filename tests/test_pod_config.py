"""`pod_check --config`: a model's own tables and features, from a JSON file
or from its specs, become the workload that `pod_check` compiles (the
compile itself is in test_pod_check.py); bad files are refused by name."""

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, make_mesh

import pallas_emb as pe
from pallas_emb.errors import ConfigError, SpecError
from pallas_emb.job.model import build_ranking
from pallas_emb.pod_check import config

EXAMPLE = os.path.join(REPO, "docs", "pod_check_example.json")


def test_the_example_file_gives_each_table_its_own_dtype_optimizer_and_rounding():
  workload = config.load(EXAMPLE)
  assert workload.examples_per_chip == 1024 and workload.num_dense == 13
  bags = {f.name: (f.table, f.num_rows, f.bag_size, f.combiner) for f in workload.features}
  assert bags == {
    "user": ("user", 2_000_000, 1, "sum"),
    "item": ("item", 1_000_000, 1, "sum"),
    "history": ("item", 1_000_000, 20, "mean"),
    "country": ("country", 256, 1, "sum"),
  }
  # The ranking model of pod_check, on this machine's CPU devices.
  emb, model = build_ranking(
    workload,
    make_mesh(4),
    emb_dim=workload.emb_dim,
    optimizer=None,
    backend="xla",
    table_options=workload.table_options,
  )
  user, item, country = (emb.logical_spec(n) for n in ("user", "item", "country"))
  assert (user.dim, np.dtype(user.dtype), user.stochastic_rounding) == (64, jnp.bfloat16, True)
  assert user.optimizer == pe.LazyAdam(0.001)
  assert (item.dim, np.dtype(item.dtype), item.optimizer) == (32, np.float32, pe.Adagrad(0.05))
  assert (country.dim, country.optimizer) == (16, pe.SGD())
  assert model.input_dim == 64 + 32 + 32 + 16 + 13


def test_specs_give_the_same_workload_as_their_file():
  user = dict(optimizer=pe.LazyAdam(0.001), dtype=jnp.bfloat16, stochastic_rounding=True)
  tables = [
    pe.TableSpec("user", 2_000_000, 64, **user),
    pe.TableSpec("item", 1_000_000, 32, optimizer=pe.Adagrad(0.05)),
    pe.TableSpec("country", 256, 16, optimizer=pe.SGD()),
  ]
  features = [
    pe.FeatureSpec("user", "user"),
    pe.FeatureSpec("item", "item"),
    pe.FeatureSpec("history", "item", "mean"),
    pe.FeatureSpec("country", "country"),
  ]
  from_specs = config.workload_from_specs(
    tables, features, {"history": 20}, examples_per_chip=1024, num_dense=13
  )
  from_file = config.load(EXAMPLE)
  assert from_specs.features == from_file.features
  assert from_specs.table_options == from_file.table_options


def _config(**changes):
  base = {
    "tables": {"t": {"rows": 100, "dim": 16}},
    "features": {"f": {"table": "t"}},
  }
  for path, value in changes.items():
    *keys, last = path.split(".")
    node = base
    for k in keys:
      node = node[k]
    node[last] = value
  return base


@pytest.mark.parametrize(
  "changes, error, match",
  [
    ({"tables.t.width": 8}, ConfigError, r"table 't': unknown keys \['width'\].*takes"),
    ({"tables.t.optimizer": "adam"}, ConfigError, r"optimizer 'adam' is not one of"),
    ({"tables.t.optimizer": {"name": "sgd", "lr": 1}}, ConfigError, r"optimizer 'sgd'.*lr"),
    ({"tables.t.dtype": "float16"}, ConfigError, r"dtype must be 'float32' or 'bfloat16'"),
    ({"tables.t.stochastic_rounding": True}, SpecError, r"stochastic_rounding applies to bfloat16"),
    ({"features.f.table": "u"}, ConfigError, r"reads table 'u', which is not among"),
    ({"features.f.bag": 0}, ConfigError, r"bag must be a positive int, got 0"),
    ({"features.g": {"table": "t", "combiner": "max"}}, SpecError, r"combiner"),
    ({"tables.u": {"rows": 8, "dim": 8}}, ConfigError, r"tables \['u'\] are read by no feature"),
    ({"batch": 8}, ConfigError, r"the configuration: unknown keys \['batch'\]"),
    ({"tables": {}}, ConfigError, r"'tables' must be a non-empty object"),
  ],
)
def test_bad_configurations_are_refused_by_name(changes, error, match):
  with pytest.raises(error, match=match):
    config.from_dict(_config(**changes))


def test_an_unreadable_file_is_named(tmp_path):
  path = tmp_path / "model.json"
  path.write_text("{tables: 1}")
  with pytest.raises(ConfigError, match=r"model.json.*cannot read it as JSON"):
    config.load(str(path))


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--dim=16,x"], r"--dim takes positive ints, got 'x'"),
    (["--dim=0"], r"--dim takes positive ints, got '0'"),
    (["--dtype=float16"], r"--dtype: 'float16' is not one of float32, bfloat16"),
    (["--optimizer=adam"], r"--optimizer: 'adam' is not one of"),
    ([f"--config={EXAMPLE}", "--dim=16,32"], r"--config sets each table's dim"),
  ],
)
def test_pod_check_flags_are_refused_by_name(argv, match, capsys):
  from pallas_emb.pod_check.__main__ import _parse  # pylint: disable=g-import-not-at-top

  with pytest.raises(SystemExit):
    _parse(argv)
  assert re.search(match, capsys.readouterr().err), capsys.readouterr().err


def test_pod_check_lists_compile_every_combination():
  from pallas_emb.pod_check.__main__ import _parse  # pylint: disable=g-import-not-at-top

  args = _parse(["--dim=16,32", "--dtype=float32,bfloat16", "--optimizer=sgd"])
  assert (args.dim, args.dtype, args.optimizer) == ([16, 32], ["float32", "bfloat16"], ["sgd"])


def test_a_process_whose_jax_started_without_the_compile_environment_is_refused():
  """This process imported JAX under the test's environment (a compilation
  cache, no TPU topology): libtpu would not see what `prepare` sets. A
  process that `prepare` set up first may compile case after case
  (test_pod_check.py runs its cases so)."""
  from pallas_emb.pod_check import env

  with pytest.raises(RuntimeError, match="must run before JAX is imported"):
    env.prepare()
