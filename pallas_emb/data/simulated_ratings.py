"""A MovieLens-format ratings file from a planted model, for when no real
MovieLens release is at hand (tests, the README's no-network numbers).

It is not MovieLens: users and items have hidden taste vectors, item
popularity is Zipf, users arrive over time and rate items they probably
like; rating >= 4 with probability sigmoid(taste . appeal + item bias).
Written as `u.data` (user, item, rating, timestamp, tab-separated).
"""

from __future__ import annotations

import numpy as np


def write_simulated_ratings(
  path: str,
  *,
  num_users: int = 2000,
  num_items: int = 1000,
  ratings_per_user: int = 50,
  latent_dim: int = 8,
  seed: int = 0,
) -> int:
  """Writes the ratings to `path` (u.data format) -> number of ratings."""
  rng = np.random.default_rng(seed)
  taste = rng.normal(size=(num_users, latent_dim)) / np.sqrt(latent_dim) * 2.5
  appeal = rng.normal(size=(num_items, latent_dim))
  item_bias = rng.normal(loc=-1.0, scale=0.7, size=num_items)
  popularity = 1.0 / np.arange(1, num_items + 1) ** 0.9
  popularity = popularity[rng.permutation(num_items)]
  arrival = rng.uniform(0, 1.0, num_users)
  rows = []
  for u in range(num_users):
    n = max(2, int(rng.poisson(ratings_per_user)))
    affinity = taste[u] @ appeal.T + item_bias
    # Users pick what is popular and what they like.
    pick = popularity * np.exp(0.3 * affinity)
    items = rng.choice(num_items, size=min(n, num_items), replace=False, p=pick / pick.sum())
    positive = rng.uniform(size=len(items)) < 1 / (1 + np.exp(-affinity[items]))
    rating = np.where(positive, rng.integers(4, 6, len(items)), rng.integers(1, 4, len(items)))
    times = arrival[u] + np.sort(rng.exponential(0.05, len(items)))
    for i, r, t in zip(items, rating, times):
      rows.append((u + 1, int(i) + 1, int(r), int(8.8e8 + t * 3e7)))
  with open(path, "w") as f:
    f.writelines(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows)
  return len(rows)
