"""PNG plots of one sweep's records (matplotlib, headless).

Each function returns the file it wrote, or None when the records hold nothing to plot
(a measured sweep has no breakdown or memory analysis; a sweep without a token budget
has no time to train). Generations keep one colour in every plot; strong scaling is a
solid line, weak scaling dashed.
"""

import os

import matplotlib

matplotlib.use("Agg")  # headless: no display on a cluster node or in CI
# pylint: disable=wrong-import-position
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, NullFormatter

from reference import mlperf_gpt3
from report import points

_COLOURS = {
  "a100": "tab:gray",
  "h100": "tab:blue",
  "h200": "tab:cyan",
  "b200": "tab:green",
  "gb200": "tab:orange",
  "gb300": "tab:red",
}
_STYLES = {"strong": "-", "weak": "--", "configured": ":"}
_SCALING_LABELS = {
  "strong": "strong scaling (fixed batch)",
  "weak": "weak scaling (fixed batch per replica)",
  "configured": "each count's own configuration",
}
_PARTS = (
  ("compute_s", "compute", "tab:blue"),
  ("exposed_comm_s", "exposed communication", "tab:red"),
  ("bubble_s", "pipeline bubble", "tab:purple"),
  ("other_s", "other", "tab:gray"),
)


def _ok(records: list[dict]) -> list[dict]:
  return [r for r in records if r["status"] == "ok"]


def _series(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
  """(hardware, scaling) -> its records by ascending device count, in sweep order."""
  out: dict[tuple[str, str], list[dict]] = {}
  for r in records:
    out.setdefault((r["hardware"], r["scaling"]), []).append(r)
  return {k: sorted(v, key=lambda r: r["devices"]) for k, v in out.items()}


def _colour(hardware: str) -> str:
  return _COLOURS.get(hardware, "black")


def _device_label(records: list[dict]) -> str:
  if records[0]["sweep_mode"] == "project":
    return "GPUs"
  return f"{records[0]['hardware'].upper()} devices"


def _title(records: list[dict], what: str) -> str:
  r = records[0]
  return f"{r['experiment']} ({r['model']}): {what}"


def _log2_x(ax, records: list[dict]) -> None:
  counts = sorted({r["devices"] for r in records})
  ax.set_xscale("log", base=2)
  ticks = [c for c in counts if c & (c - 1) == 0] or counts  # powers of two
  ax.set_xticks(ticks)
  ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
  ax.xaxis.set_minor_formatter(NullFormatter())


def _legend(ax, records: list[dict], extra: list | None = None, loc: str = "best") -> None:
  """One entry per generation (colour) and per scaling rule (line style)."""
  handles = [
    Line2D([], [], color=_colour(h), marker="o", label=h.upper())
    for h in dict.fromkeys(r["hardware"] for r in records)
  ]
  handles += [
    Line2D([], [], color="black", linestyle=_STYLES[s], label=_SCALING_LABELS[s])
    for s in dict.fromkeys(r["scaling"] for r in records)
  ]
  ax.legend(handles=handles + (extra or []), fontsize=8, loc=loc)


def _save(fig, path: str, bottom: float = 0.0) -> str:
  fig.tight_layout(rect=(0, bottom, 1, 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def scaling_efficiency(records: list[dict], path: str) -> str | None:
  ok = _ok(records)
  if not ok:
    return None
  fig, ax = plt.subplots(figsize=(8, 5))
  for (hardware, scaling), rs in _series(ok).items():
    ax.plot(
      [r["devices"] for r in rs],
      [100 * r["scaling_efficiency"] for r in rs],
      color=_colour(hardware),
      linestyle=_STYLES[scaling],
      marker="o",
      markersize=4,
    )
  ax.axhline(100, color="black", linewidth=0.5)
  ax.set_ylim(bottom=0)
  _log2_x(ax, ok)
  ax.set_xlabel(f"{_device_label(ok)} (log scale)")
  ax.set_ylabel("scaling efficiency (%)\nper-device tokens/s vs. smallest point")
  ax.set_title(_title(ok, "scaling efficiency"))
  ax.grid(True, which="major", alpha=0.3)
  _legend(ax, ok)
  return _save(fig, path)


def time_to_train(records: list[dict], path: str) -> str | None:
  ok = [r for r in _ok(records) if r.get("time_to_train_min")]
  if not ok:
    return None
  fig, ax = plt.subplots(figsize=(8, 5))
  for (hardware, scaling), rs in _series(ok).items():
    ax.plot(
      [r["devices"] for r in rs],
      [r["time_to_train_min"] for r in rs],
      color=_colour(hardware),
      linestyle=_STYLES[scaling],
      marker="o",
      markersize=4,
    )
  extra, lowest = [], min(r["time_to_train_min"] for r in ok)
  if ok[0]["sweep_mode"] == "project":
    for i, (label, hardware, gpus, minutes) in enumerate(mlperf_gpt3.RESULTS):
      ax.plot(
        gpus,
        minutes,
        marker="*",
        markersize=14,
        color=_colour(hardware),
        markeredgecolor="black",
        linestyle="none",
      )
      ax.annotate(
        f"{label}: {minutes} min",
        (gpus, minutes),
        fontsize=7,
        xytext=(-10, -4 - 10 * (i % 2)),
        textcoords="offset points",
        ha="right",
        va="top",
      )
      lowest = min(lowest, minutes)
    extra = [
      Line2D(
        [],
        [],
        marker="*",
        markersize=12,
        color="white",
        markeredgecolor="black",
        linestyle="none",
        label="published MLPerf result",
      )
    ]
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_ylim(bottom=lowest / 4)  # room for the labels under the lowest marker
  _log2_x(ax, ok)
  ax.set_xlabel(f"{_device_label(ok)} (log scale)")
  ax.set_ylabel("time to train (minutes, log scale)")
  budget = ok[0].get("token_budget")
  label = ok[0].get("token_budget_label") or (budget and f"{budget / 1e9:.2f} B tokens")
  what = f"time to train\n{label}" if label else "time to train"
  ax.set_title(_title(ok, what))
  ax.grid(True, which="both", alpha=0.3)
  _legend(ax, ok, extra, loc="upper right")  # times fall to the lower right
  return _save(fig, path)


def step_breakdown(records: list[dict], path: str) -> str | None:
  """Stacked share of the step time per part, one panel per generation; one series each
  (weak scaling when the sweep has it: it runs at every count the mesh allows)."""
  ok = [r for r in _ok(records) if "breakdown" in r]
  if not ok:
    return None
  scaling = next(s for s in ("weak", "configured", "strong") if any(r["scaling"] == s for r in ok))
  ok = [r for r in ok if r["scaling"] == scaling]
  hardware = list(dict.fromkeys(r["hardware"] for r in ok))
  columns = min(3, len(hardware))
  rows = -(-len(hardware) // columns)
  fig, axes = plt.subplots(
    rows, columns, figsize=(4.5 * columns, 3.6 * rows), squeeze=False, sharey=True
  )
  parts = [p for p in _PARTS if any(r["breakdown"].get(p[0], 0) > 0 for r in ok)]
  for ax, name in zip(axes.flat, hardware):
    rs = sorted((r for r in ok if r["hardware"] == name), key=lambda r: r["devices"])
    x = range(len(rs))
    bottom = [0.0] * len(rs)
    for key, label, colour in parts:
      share = [100 * r["breakdown"].get(key, 0.0) / r["step_time_s"] for r in rs]
      ax.bar(x, share, bottom=bottom, color=colour, label=label, width=0.8)
      bottom = [b + s for b, s in zip(bottom, share)]
    for i, r in enumerate(rs):
      ax.text(i, 101, f"{r['step_time_s']:.3g}", ha="center", va="bottom", fontsize=6, rotation=90)
      # A searched sweep's point: the configuration it runs, up its bar.
      ax.text(i, 2, points.configuration_text(r), ha="center", va="bottom", fontsize=5, rotation=90)
    ax.set_xticks(list(x), [f"{r['devices']:,}" for r in rs], rotation=90, fontsize=7)
    ax.set_ylim(0, 125)
    ax.set_title(name.upper(), fontsize=10)
    ax.set_xlabel("GPUs", fontsize=8)
  for ax in axes[:, 0]:
    ax.set_ylabel("share of step time (%)")
  for ax in axes.flat[len(hardware) :]:
    ax.axis("off")
  handles, labels = axes.flat[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=len(parts), fontsize=8)
  fig.suptitle(
    _title(ok, f"step-time breakdown, {_SCALING_LABELS[scaling]}")
    + "\nshare of each step; step time in seconds above each bar"
    + ("; the searched configuration up each bar" if any("search" in r for r in ok) else ""),
    fontsize=10,
  )
  return _save(fig, path, bottom=0.35 / (3.6 * rows))


def memory(records: list[dict], path: str) -> str | None:
  """Memory per GPU against GPU count, one panel per generation with its HBM capacity."""
  measured = [r for r in records if r.get("memory_per_gpu_gb") is not None]
  if not measured:
    return None
  hardware = list(dict.fromkeys(r["hardware"] for r in measured))
  columns = min(3, len(hardware))
  rows = -(-len(hardware) // columns)
  fig, axes = plt.subplots(
    rows, columns, figsize=(4.5 * columns, 3.4 * rows), squeeze=False, sharey=True
  )
  top = max(max(r["hbm_capacity_gb"], r["memory_per_gpu_gb"]) for r in measured)
  for ax, name in zip(axes.flat, hardware):
    mine = [r for r in measured if r["hardware"] == name]
    for (_, scaling), rs in _series(mine).items():
      ax.plot(
        [r["devices"] for r in rs],
        [r["memory_per_gpu_gb"] for r in rs],
        color=_colour(name),
        linestyle=_STYLES[scaling],
        marker="o",
        markersize=4,
        label=_SCALING_LABELS[scaling],
      )
    capacity = mine[0]["hbm_capacity_gb"]
    ax.axhline(
      capacity, color="black", linestyle=":", linewidth=1.5, label=f"HBM capacity {capacity:.0f} GB"
    )
    over = [r for r in mine if r["status"] == "does_not_fit"]
    if over:
      ax.plot(
        [r["devices"] for r in over],
        [r["memory_per_gpu_gb"] for r in over],
        "x",
        color="black",
        markersize=9,
        linestyle="none",
        label="does not fit",
      )
    _log2_x(ax, mine)
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    ax.set_ylim(0, 1.3 * top)  # headroom for the legend above the capacity line
    ax.set_title(name.upper(), fontsize=10)
    ax.set_xlabel("GPUs (log scale)", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
  for ax in axes[:, 0]:
    ax.set_ylabel("memory per GPU (GB)")
  for ax in axes.flat[len(hardware) :]:
    ax.axis("off")
  fig.suptitle(_title(measured, "memory per GPU vs. HBM capacity"), fontsize=10)
  return _save(fig, path)


PLOTS = {
  "scaling_efficiency": scaling_efficiency,
  "time_to_train": time_to_train,
  "step_breakdown": step_breakdown,
  "memory": memory,
}


def write_all(records: list[dict], output_dir: str) -> dict[str, str | None]:
  """Every plot the records support, as DIR/<name>.png; name -> path or None."""
  return {
    name: plot(records, os.path.join(output_dir, f"{name}.png")) for name, plot in PLOTS.items()
  }
