"""Imports go one way: each layer, imported alone in a fresh interpreter,
loads only the layers below it (DESIGN.md's layering)."""

import json
import subprocess
import sys

import pytest

# Module -> the pallas_emb modules (prefixes) it may load. `pallas_emb` is
# the package itself, whose __init__ loads its public names lazily.
LEAVES = ("pallas_emb", "pallas_emb.errors", "pallas_emb.packing", "pallas_emb.stored_rows")
INPUTS = ("pallas_emb", "pallas_emb.errors", "pallas_emb.inputs")
KERNELS = LEAVES + ("pallas_emb.kernels",)
OPTIMIZERS = LEAVES + ("pallas_emb.optimizers",)
SPARSE = (
  KERNELS
  + OPTIMIZERS
  + (
    "pallas_emb.spec",
    "pallas_emb.capacity",
    "pallas_emb.state",
    "pallas_emb.tokens",
    "pallas_emb.placement",
    "pallas_emb.shard_ops",
    "pallas_emb.shard_kernels",
    "pallas_emb.programs",
    "pallas_emb.validate",
    "pallas_emb.ids",
    "pallas_emb.inputs",
    "pallas_emb.pooling",
    "pallas_emb.embedding",
    "pallas_emb.stacking",
    "pallas_emb.replicated_ops",
    "pallas_emb.sharded_table",
    "pallas_emb.norms",
    "pallas_emb.dynamic",
    "pallas_emb.vocabulary",
    "pallas_emb.hashing",
    "pallas_emb.threefry",
  )
)
ALLOWED = {
  "sharding": (),
  "pallas_emb.errors": ("pallas_emb", "pallas_emb.errors"),
  "pallas_emb.packing": ("pallas_emb", "pallas_emb.errors", "pallas_emb.packing"),
  # Reads and writes rows in packing's layout, and nothing above it.
  "pallas_emb.stored_rows": LEAVES,
  "pallas_emb.inputs": INPUTS,
  "pallas_emb.ids": INPUTS + ("pallas_emb.ids",),
  "pallas_emb.hashing": ("pallas_emb", "pallas_emb.errors", "pallas_emb.hashing"),
  "pallas_emb.vocabulary": (
    "pallas_emb",
    "pallas_emb.errors",
    "pallas_emb.hashing",
    "pallas_emb.vocabulary",
  ),
  "pallas_emb.kernels": KERNELS,
  "pallas_emb.kernels.xla": KERNELS,
  "pallas_emb.optimizers": OPTIMIZERS,
  "pallas_emb.norms": ("pallas_emb", "pallas_emb.norms"),
  "pallas_emb.threefry": ("pallas_emb", "pallas_emb.threefry"),
  "pallas_emb.placement": ("pallas_emb", "pallas_emb.placement"),
  "pallas_emb.stacking.members": ("pallas_emb", "pallas_emb.stacking"),
  "pallas_emb.embedding": SPARSE,
  "pallas_emb.async_emb": SPARSE + ("pallas_emb.async_emb",),
  # The library never loads the main job or the benchmarks.
  "pallas_emb.train": SPARSE + ("pallas_emb.async_emb", "pallas_emb.train"),
  "pallas_emb.data": INPUTS + ("pallas_emb.ids", "pallas_emb.data"),
  # Serving loads no training, optimizer or kernel module: a server needs
  # the artifact, JAX and the host-side id conversions only.
  "pallas_emb.serving": INPUTS
  + (
    "pallas_emb.ids",
    "pallas_emb.tokens",
    "pallas_emb.pooling",
    "pallas_emb.hashing",
    "pallas_emb.vocabulary",
    "pallas_emb.serving",
  ),
}


# One fresh interpreter loads the third-party libraries, then forks a child
# per module: each child starts with no pallas_emb module loaded and imports
# only the one under test (which pallas_emb modules come with it is all that
# is checked), without paying for JAX's import again.
_PROBE = """
import json, os, sys
import jax, jax.numpy, numpy, optax, absl.flags, orbax.checkpoint, grain
out = {}
for module in sys.argv[1:]:
  read, write = os.pipe()
  if os.fork() == 0:
    os.close(read)
    __import__(module)
    names = sorted(m for m in sys.modules if m.split(".")[0] in ("pallas_emb", "sharding"))
    os.write(write, json.dumps(names).encode())
    os._exit(0)
  os.close(write)
  with os.fdopen(read) as f:
    out[module] = json.loads(f.read())
  os.wait()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def loaded_by() -> dict[str, list[str]]:
  """Module -> the pallas_emb and sharding modules importing it loads."""
  out = subprocess.run(
    [sys.executable, "-c", _PROBE, "sharding", *sorted(ALLOWED)],
    check=True,
    capture_output=True,
    text=True,
    timeout=300,
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_a_layer_loads_only_the_layers_below_it(module, loaded_by):
  loaded = [m for m in loaded_by[module] if m.split(".")[0] == "pallas_emb"]
  allowed = ALLOWED[module]
  upward = [
    m
    for m in loaded
    if not any(m == a or m.startswith(a + ".") for a in allowed if a != "pallas_emb")
    and m != "pallas_emb"
  ]
  assert not upward, f"importing {module} loaded {upward}"


def test_sharding_never_imports_pallas_emb(loaded_by):
  assert not [m for m in loaded_by["sharding"] if m.startswith("pallas_emb")]


def test_the_public_api_still_loads_from_the_package():
  import pallas_emb as pe

  for name in pe.__all__:
    assert getattr(pe, name) is not None, name
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    getattr(pe, "nope")  # noqa: B009  (the lazy __getattr__ itself is tested)
