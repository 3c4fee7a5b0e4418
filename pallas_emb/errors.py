"""The exception types of pallas_emb.

Every error names the offending value, the limit it broke and the fix. All are
subclasses of the builtin a caller would catch anyway (`ValueError` for a bad
argument, `RuntimeError` for a call out of order).
"""


class SpecError(ValueError):
  """A TableSpec, FeatureSpec or optimizer was built with invalid arguments."""


class InputError(ValueError):
  """Arrays passed to lookup or update do not match the specs (name, dtype,
  shape, sharding)."""


class BackendError(ValueError):
  """An unknown backend, or a backend that cannot run on this platform."""


class VmemBudgetError(ValueError):
  """A kernel's chunk size needs more VMEM than the target chip has."""


class ConfigError(ValueError):
  """A configuration that cannot work, refused before anything is traced: a
  TrainConfig whose optimizer cannot fuse, or a kernel's chunk size,
  interpret mode or target chip."""


class AsyncEmbStateError(RuntimeError):
  """An asynchronous embedding call made out of order (start/done/lookup)."""
