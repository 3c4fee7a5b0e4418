"""The exception types of pallas_emb.

Every error names the offending value, the limit it broke and the fix. All are
a `PallasEmbError`, and subclasses of the builtin a caller would catch anyway
(`ValueError` for a bad argument or checkpoint, `RuntimeError` for a call out
of order, `OSError` for a directory that cannot be written).
"""

import numbers


class PallasEmbError(Exception):
  """The base of every exception type here: `except PallasEmbError` catches
  the library's own errors (the main job prints them as one line)."""


class SpecError(PallasEmbError, ValueError):
  """A TableSpec, FeatureSpec or optimizer was built with invalid arguments."""


class InputError(PallasEmbError, ValueError):
  """Arrays passed to lookup or update do not match the specs (name, dtype,
  shape, sharding)."""


class BackendError(PallasEmbError, ValueError):
  """An unknown backend, or a backend that cannot run on this platform."""


class VmemBudgetError(PallasEmbError, ValueError):
  """A kernel's chunk size needs more VMEM than the target chip has."""


class ConfigError(PallasEmbError, ValueError):
  """A configuration that cannot work, refused before anything is traced: a
  TrainConfig whose optimizer cannot fuse, or a kernel's chunk size,
  interpret mode or target chip."""


class AsyncEmbStateError(PallasEmbError, RuntimeError):
  """An asynchronous embedding call made out of order (start/done/lookup)."""


class EmptyInputError(InputError):
  """A batch with no examples, or a feature whose bags hold no id."""


class MeshMismatchError(InputError):
  """A table, context or pending update made for another device mesh (other
  devices, or the same devices in another order or under other axis names)."""


class PlacementError(MeshMismatchError):
  """Ids committed to devices outside the table's mesh, or to another mesh
  of its devices."""


class UpdateMismatchError(InputError):
  """A pending `AsyncEmbGradientUpdate` handed to another table's context."""


class CheckpointError(PallasEmbError, ValueError):
  """A checkpoint that cannot be restored into the trainer at hand."""


class CheckpointMismatchError(CheckpointError):
  """A checkpoint written with other tables, optimizer, batch shapes or
  pipeline than the trainer it is restored into."""


class CheckpointCorruptError(CheckpointError):
  """No checkpoint step (or not the one asked for) reads back intact."""


class ServingArtifactError(CheckpointError):
  """A serving artifact (`pallas_emb.export_serving`'s directory) with a
  missing, unreadable or corrupt file."""


class CheckpointDirError(PallasEmbError, OSError):
  """A checkpoint directory that cannot be written (checked before training,
  and on every save)."""


def check_int(
  value,
  name: str,
  *,
  minimum: int = 1,
  error: type = ValueError,
  optional: bool = False,
  fix: str = "",
) -> int | None:
  """`value` as an int, if it is an integer (not a bool) >= `minimum`.

  The one check of a count, size or capacity: every module calls it with its
  own exception type and, in `fix`, what to pass instead.

  Args:
    optional: None is accepted too (and returned).

  Raises:
    error: naming `name`, the value (and its type, if not an int) and the
      lower bound.
  """
  if optional and value is None:
    return None
  alternative = " or None" if optional else ""
  fix = f" {fix}" if fix else ""
  if not isinstance(value, numbers.Integral) or isinstance(value, bool):
    raise error(
      f"{name} must be an int{alternative}, got {value!r} of type {type(value).__name__}.{fix}"
    )
  if value < minimum:
    bound = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    raise error(f"{name} must be {bound}{alternative}, got {value!r}.{fix}")
  return int(value)
