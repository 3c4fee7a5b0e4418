"""Reading a compiled TPU step: collectives, copies, kernels and overlap.

Every function takes `compiled.as_text()`: the optimized, scheduled HLO of
one chip's program. Its ENTRY computation lists instructions in execution
order, so whatever the schedule puts between an asynchronous collective's
`-start` and its `-done` runs while the collective is in flight; a bare
`all-to-all(` is synchronous and overlaps nothing.
"""

from __future__ import annotations

import collections
import re

_DTYPE_BYTES = {
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "bf16": 2,
  "f16": 2,
  "s8": 1,
  "u8": 1,
  "pred": 1,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}
_HLO_TYPES = {
  "float32": "f32",
  "int32": "s32",
  "uint32": "u32",
  "bfloat16": "bf16",
  "float16": "f16",
  "int8": "s8",
  "uint8": "u8",
  "bool": "pred",
  "int64": "s64",
  "uint64": "u64",
  "float64": "f64",
}
_SHAPE = re.compile(r"\b(f32|s32|u32|bf16|f16|s8|u8|pred|s64|u64|f64)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_COLLECTIVES = (
  "all-to-all",
  "ragged-all-to-all",
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "collective-permute",
)


def _bytes(shape_text: str) -> int:
  """Bytes of the first array shape in `shape_text`."""
  m = _SHAPE.search(shape_text)
  if not m:
    return 0
  dims = [int(d) for d in m.group(2).split(",") if d]
  n = 1
  for d in dims:
    n *= d
  return n * _DTYPE_BYTES[m.group(1)]


def _instructions(text: str, entry_only: bool):
  lines = text.splitlines()
  if entry_only:
    start = next(i for i, l in enumerate(lines) if l.startswith("ENTRY"))
    lines = lines[start + 1 :]
    end = next((i for i, l in enumerate(lines) if l.startswith("}")), len(lines))
    lines = lines[:end]
  for line in lines:
    m = _INSTRUCTION.match(line)
    if m:
      yield m.group(1), m.group(2), m.group(3), line


def collectives(text: str) -> list[dict]:
  """Every collective of the program: its op, operand bytes, dtype and dims
  (of the first array in its shape), `dimensions` attribute, and whether it
  is asynchronous (a -start/-done pair)."""
  out = []
  for name, shape, op, line in _instructions(text, entry_only=False):
    base = op.removesuffix("-start")
    if base in _COLLECTIVES and not op.endswith("-done"):
      m = _SHAPE.search(shape)
      attr = re.search(r"dimensions=\{([\d,]*)\}", line)
      out.append(
        {
          "name": name,
          "op": base,
          "bytes": _bytes(shape),
          "dtype": m.group(1) if m else "",
          "dims": [int(d) for d in m.group(2).split(",") if d] if m else [],
          "dimensions": tuple(int(d) for d in attr.group(1).split(",") if d) if attr else (),
          "async": op.endswith("-start"),
        }
      )
  return out


def copies_of(text: str, arrays, *, prefetch: bool = False) -> list[str]:
  """Copies of an array like one of `arrays` (a table or slot shard).

  Args:
    arrays: (shape, dtype) pairs, the shape as (rows, columns), the dtype
      as NumPy names it; an (R, 1) shape also matches (R,). The dtype
      tells a table's copy from a per-id work array whose capacity is the
      shard's rows (int32 ids of a table of float32 rows).
    prefetch: False: relayouts (`copy`), which rewrite the array every step.
      True: asynchronous copies (`copy-start`) and slices (`slice-start`,
      matched by the array sliced), which XLA's memory space assignment
      issues to stage an array, or pieces of it, in VMEM.
  """
  wanted = set()
  for shape, dtype in arrays:
    name = _HLO_TYPES[str(dtype)]
    wanted.add((tuple(shape), name))
    if tuple(shape[1:]) == (1,):
      wanted.add(((shape[0],), name))
  found = []
  for name, shape, op, _ in _instructions(text, entry_only=False):
    m = _SHAPE.search(shape)
    if op in (("copy-start", "slice-start") if prefetch else ("copy",)) and m:
      dims = tuple(int(d) for d in m.group(2).split(",") if d)
      if (dims, m.group(1)) in wanted:
        found.append(f"{name} {m.group(0)}")
  return found


def kernel_calls(text: str) -> int:
  """Pallas (Mosaic) kernel launches per step."""
  return sum(kernels_by_name(text).values())


def kernels_by_name(text: str) -> dict[str, int]:
  """Pallas (Mosaic) kernel launches per step, by the jitted function that
  issued the `pallas_call` (`_block_gather_call`, `_block_update_call`)."""
  counts = collections.Counter()
  for _, _, op, line in _instructions(text, entry_only=False):
    if op == "custom-call" and "tpu_custom_call" in line:
      m = re.search(r"jit\((\w+)\)/pallas_call", line)
      counts[m.group(1) if m else "?"] += 1
  return dict(counts)


def _dense_computations(text: str) -> set[str]:
  """Computations that contain a matmul (the dense model's work)."""
  dense = set()
  for m in re.finditer(r"\n(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", text, re.S):
    if re.search(r" (convolution|dot)\(", m.group(2)):
      dense.add(m.group(1))
  return dense


def overlap(text: str) -> dict:
  """How the schedule overlaps collectives with the dense compute.

  Returns:
    {"async_collectives": pairs in the entry schedule, "overlapping": pairs
    with at least one matmul scheduled between start and done,
    "dense_ops": matmuls in the entry schedule, "pairs": per pair the op,
    the program that issued it (e.g. the update, `apply_token_gradients`)
    and the matmuls between}.
  """
  dense = _dense_computations(text)
  ops = []
  for name, _, op, line in _instructions(text, entry_only=True):
    calls = re.search(r"calls=(%[\w.\-]+)", line)
    is_dense = op in ("convolution", "dot") or (
      op == "fusion" and calls is not None and calls.group(1) in dense
    )
    operand = re.search(r"-done\((%[\w.\-]+)", line)
    source = re.search(r'op_name="[^"]*?jit\((\w+)\)/shard_map', line)
    ops.append(
      (name, op, is_dense, operand.group(1) if operand else None, source.group(1) if source else "")
    )
  starts = {
    name: i
    for i, (name, op, *_) in enumerate(ops)
    if op.endswith("-start") and op.removesuffix("-start") in _COLLECTIVES
  }
  pairs = []
  for i, (_, op, _, operand, _) in enumerate(ops):
    if op.endswith("-done") and operand in starts:
      s = starts[operand]
      between = sum(1 for j in range(s + 1, i) if ops[j][2])
      pairs.append(
        {"op": op.removesuffix("-done"), "program": ops[s][4], "dense_ops_between": between}
      )
  counts = collections.Counter(p["dense_ops_between"] > 0 for p in pairs)
  return {
    "async_collectives": len(pairs),
    "overlapping": counts[True],
    "dense_ops": sum(1 for o in ops if o[2]),
    "pairs": pairs,
  }
