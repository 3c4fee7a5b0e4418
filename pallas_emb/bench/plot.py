"""The benchmark's plot: step time against V and N, log-log."""

from __future__ import annotations


def plot(results: dict, path: str) -> None:
  """Log-log step time against V (one line per method and N) and, when the
  run has several N, against N (one line per method and V)."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  ws = results["workloads"]
  sizes = {"vocab": sorted({w["vocab"] for w in ws}), "ids": sorted({w["ids"] for w in ws})}
  axes_over = [x for x in ("vocab", "ids") if len(sizes[x]) > 1] or ["vocab"]
  fig, axes = plt.subplots(1, len(axes_over), figsize=(6.5 * len(axes_over), 4.5), squeeze=False)
  methods = sorted({m for w in ws for m in w["methods"]})
  colors = {m: f"C{i}" for i, m in enumerate(methods)}
  for ax, x in zip(axes[0], axes_over):
    other = "ids" if x == "vocab" else "vocab"
    styles = dict(zip(sizes[other], ["-", "--", ":", "-."] * 4))
    markers = dict(zip(sizes[other], "osD^v<>" * 4))
    for method in methods:
      for o in sizes[other]:
        pts = sorted(
          (w[x], w["methods"][method]["median_ms"])
          for w in ws
          if w[other] == o and method in w["methods"]
        )
        if pts:
          ax.plot(
            *zip(*pts),
            color=colors[method],
            ls=styles[o],
            marker=markers[o],
            label=f"{method}, {'N' if other == 'ids' else 'V'}={o:,}",
          )
    for o in sizes[other]:
      pts = sorted((w[x], w["floor_ms"]) for w in ws if w[other] == o)
      ax.plot(
        *zip(*pts),
        color="k",
        ls=styles[o],
        lw=0.8,
        alpha=0.6,
        label=f"memory floor, {'N' if other == 'ids' else 'V'}={o:,}",
      )
    ax.set(
      xscale="log",
      yscale="log",
      xlabel="table rows V" if x == "vocab" else "ids per step N",
      ylabel="update step time (ms, median)",
      title=f"row-wise Adagrad update, D={ws[0]['dim']}",
    )
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
