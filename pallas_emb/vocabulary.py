"""A dynamic vocabulary: raw 64-bit ids admitted, stored and evicted in
training, each resident id owning one row (no collisions).

`DynamicVocabulary` is static configuration, given as
`TableSpec(vocabulary=...)`; the table's `num_rows` is then its capacity.
The state (the id -> row map, per-row metadata and the admission sketch)
lives in `sharding.id_map.IdMap`, a pytree the step returns; the jitted
programs are in `pallas_emb.dynamic`.

How raw ids travel. JAX runs without 64-bit types here, so a raw id cannot
enter a jitted function as int64 (it would wrap to int32). Each raw id is
reduced on the host to its 64-bit key `hash64(raw, seed)` (`pallas_emb.
hashing`: for integers a bijection of the 64-bit words, so two distinct
int64 ids never share a key; strings through FNV-1a-64, a fingerprint) and
sent as two uint32 words, (..., 2) = (high, low). The key is already well
mixed, so the device derives everything from its bits without hashing again:
the owner shard from the high word, the home slot from the low word, the
sketch counters from both. The key of the all-ones word pair marks padding;
the one raw integer whose key it would be is refused. `raw_ids` inverts the
key on the host (SplitMix64's finaliser is a bijection), so `resident_ids`
gives back the raw int64 ids (for strings: their FNV-1a-64 fingerprint).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

from pallas_emb import hashing
from pallas_emb.errors import InputError, SpecError, check_int

Policy = Literal["lfu", "lru", "ttl"]
POLICIES = ("lfu", "lru", "ttl")
PAD_WORD = np.uint32(0xFFFFFFFF)
_MASK64 = 2**64 - 1


@dataclasses.dataclass(frozen=True)
class DynamicVocabulary:
  """How a table admits, places and evicts raw ids.

  Every shard keeps an open-addressing map of `rows_per_shard` slots; slot j
  of shard s is the table's physical row s * rows_per_shard + j. An id lives
  in one of the `probe_limit` slots after its home slot (linear probing).

  Attributes:
    admit_after: occurrences before an id takes a row (1: at first sight).
      Counted in a count-min sketch of `sketch_depth` x `sketch_width`
      int32 counters per shard. The sketch ages: before a training step
      counts its ids, a shard whose fullest sketch row holds a quarter of
      `sketch_width` or more halves every counter (TinyLFU's reset), so an
      id must recur within about `sketch_width` / 8 counted ids of its
      shard, and the error stays bounded however long the stream. A sketch
      only over-counts (an id is never admitted late); an id seen c <
      admit_after times is admitted early, when every one of its counters
      is shared, with probability at most
      ((1/4 + k / sketch_width) / (admit_after - c)) ** sketch_depth, k the
      ids its shard counts in that step (Markov's bound per independent
      row): at most 0.4% for an id seen once with the defaults
      (sketch_depth=4, admit_after=2) while k is small next to the width.
      admit_after=1 needs no sketch (none is kept).
    policy: which resident id loses its row to a new one: "lfu" the least
      frequently used (its count, decayed by `decay` at every sweep; ties:
      least recently used, then first in the probe window; and only if its
      count is at most the newcomer's, its occurrences in the step or its
      sketch estimate: TinyLFU's rule), "lru" the least
      recently used (ties: first in the window), "ttl" only ids idle for
      `ttl` steps or more (the longest idle first).
    probe_limit: slots probed from an id's home slot, 1 <= P <= 64.
    evict_on_insert: when an admitted id finds no free slot in its window,
      it takes the policy's victim there (never an id used in this step or
      the previous one, whose update the async pipeline applies late).
      Otherwise the insert fails (counted).
    evict_every: None, or every this many steps a sweep runs before the
      step: "lfu" counts are multiplied by `decay`, and ids idle for `ttl`
      steps or more are evicted (when `ttl` is set).
    decay: "lfu" count multiplier per sweep, 0 < decay <= 1.
    ttl: steps an id may go unused before it may be evicted (required by
      "ttl"; for the others, what a sweep evicts).
    sketch_depth, sketch_width: the admission sketch's size per shard;
      width None = 4x the rows per shard (at least 64). A wider sketch
      remembers an id longer (its halvings are further apart) and keeps
      the bound above for larger steps.
    seed: salts the keys (`hash64(raw, seed=seed)`), hence the placement.
  """

  admit_after: int = 1
  policy: Policy = "lfu"
  probe_limit: int = 8
  evict_on_insert: bool = True
  evict_every: int | None = None
  decay: float = 0.5
  ttl: int | None = None
  sketch_depth: int = 4
  sketch_width: int | None = None
  seed: int = 0

  def __post_init__(self):
    owner = "DynamicVocabulary"
    check_int(self.admit_after, f"{owner}: admit_after", error=SpecError, fix="1 admits at once.")
    if self.policy not in POLICIES:
      raise SpecError(f"{owner}: policy must be one of {POLICIES}, got {self.policy!r}.")
    check_int(self.probe_limit, f"{owner}: probe_limit", error=SpecError, fix="8 is the default.")
    if self.probe_limit > 64:
      raise SpecError(
        f"{owner}: probe_limit={self.probe_limit} is over the limit of 64 (every id reads "
        "its whole window each step); use 8 to 32."
      )
    if not isinstance(self.evict_on_insert, bool):
      raise SpecError(f"{owner}: evict_on_insert must be a bool, got {self.evict_on_insert!r}.")
    for field in ("evict_every", "ttl", "sketch_width"):
      check_int(getattr(self, field), f"{owner}: {field}", error=SpecError, optional=True)
    check_int(self.sketch_depth, f"{owner}: sketch_depth", error=SpecError, fix="4 is the default.")
    check_int(self.seed, f"{owner}: seed", minimum=0, error=SpecError)
    if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)):
      raise SpecError(f"{owner}: decay must be a float in (0, 1], got {self.decay!r}.")
    if not 0 < self.decay <= 1:
      raise SpecError(f"{owner}: decay must be in (0, 1], got {self.decay}; 1 turns decay off.")
    if self.ttl is not None and self.ttl < 2:
      raise SpecError(
        f"{owner}: ttl={self.ttl} would evict ids used in the previous step, whose update "
        "the async pipeline applies one step late; use ttl >= 2."
      )
    if self.policy == "ttl" and self.ttl is None:
      raise SpecError(
        f"{owner}: policy 'ttl' needs ttl (the idle steps after which an id may be evicted), "
        "got None; pass ttl=, or use policy 'lru'."
      )
    if not self.evict_on_insert and (self.evict_every is None or self.ttl is None):
      raise SpecError(
        f"{owner}: with evict_on_insert=False and evict_every={self.evict_every}, "
        f"ttl={self.ttl} nothing is ever evicted and the table fills for good; set "
        "evict_on_insert=True, or both evict_every and ttl."
      )

  def width_for(self, rows_per_shard: int) -> int:
    """Counters per sketch row for shards of `rows_per_shard` slots."""
    return self.sketch_width or max(64, 4 * rows_per_shard)

  def depth(self) -> int:
    """Sketch rows kept (0: admit_after == 1 needs no counts)."""
    return 0 if self.admit_after == 1 else self.sketch_depth


def vocab_keys(raw: Any, vocabulary: DynamicVocabulary, *, pad: Any = -1) -> np.ndarray:
  """Raw ids -> (..., 2) uint32 (high, low) words of their 64-bit keys.

  Args:
    raw: integers (any width, int64 included) or strings, any shape, as
      `pallas_emb.hash64` takes; elements equal to `pad` (or None in an
      object array) are padding. Pass pad=None when every value is an id.

  Returns:
    raw.shape + (2,) uint32; padding is (0xFFFFFFFF, 0xFFFFFFFF).

  Raises:
    InputError: ids of an unsupported type, or the one raw id whose key is
      the padding key (re-salt with another `seed`).
  """
  return key_words(raw, vocabulary.seed, pad=pad)


def key_words(raw: Any, seed: int, *, pad: Any = -1) -> np.ndarray:
  """`vocab_keys` under a vocabulary's `seed` alone (what a serving
  artifact keeps of its `DynamicVocabulary`)."""
  raw = np.asarray(raw)
  padding = np.zeros(raw.shape, bool)
  if raw.dtype == object:
    padding |= np.vectorize(lambda v: v is None, otypes=[bool])(raw)
  if pad is not None:
    padding |= np.broadcast_to(np.asarray(raw == pad, bool), raw.shape)
  out = np.full((*raw.shape, 2), PAD_WORD, np.uint32)
  if (~padding).any():
    k = hashing.hash64(raw[~padding], seed=seed)
    if (k == np.uint64(_MASK64)).any():
      bad = raw[~padding][k == np.uint64(_MASK64)][0]
      raise InputError(
        f"raw id {bad!r} has the padding key 0xFFFFFFFFFFFFFFFF under seed "
        f"{seed}; use another DynamicVocabulary(seed=...)."
      )
    out[~padding] = np.stack([k >> np.uint64(32), k & np.uint64(0xFFFFFFFF)], -1).astype(np.uint32)
  return out


def _unxorshift(z: np.ndarray, s: int) -> np.ndarray:
  out = z
  for k in range(1, 64 // s + 1):
    out = out ^ (z >> np.uint64(s * k))
  return out


def raw_ids(words: np.ndarray, vocabulary: DynamicVocabulary) -> np.ndarray:
  """(n, 2) uint32 key words -> (n,) int64 raw ids (the inverse of `vocab_keys`
  for integer ids; for strings, their FNV-1a-64 fingerprint)."""
  words = np.asarray(words, np.uint32).reshape(-1, 2)
  z = (words[:, 0].astype(np.uint64) << np.uint64(32)) | words[:, 1].astype(np.uint64)
  inv1 = np.uint64(pow(0xBF58476D1CE4E5B9, -1, 2**64))
  inv2 = np.uint64(pow(0x94D049BB133111EB, -1, 2**64))
  with np.errstate(over="ignore"):
    z = _unxorshift(z, 31) * inv2
    z = _unxorshift(z, 27) * inv1
    z = _unxorshift(z, 30)
    z = z - hashing._GAMMA * np.uint64((vocabulary.seed + 1) % 2**64)  # pylint: disable=protected-access
  return z.view(np.int64)
