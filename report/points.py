"""The terminal tables of measured and projected points (launch.py's modes print them)."""

from parallelism import mesh as mesh_lib
from records.points import to_json
from report import table


def mesh_table(layout: mesh_lib.MeshLayout, platform: str) -> str:
  return table.key_values(
    f"Mesh: {layout.devices} {platform.upper()} devices as {layout.nodes} nodes "
    f"x {layout.devices_per_node}",
    [(line, "") for line in layout.describe()],
  )


def pipeline_table(fields: dict, stages: int, trips: str) -> str:
  """The schedule of a measured point with more than one stage (`fields`: its record's
  pipeline keys; `trips`: its loop trips in words)."""
  return table.key_values(
    "Pipeline",
    [
      (
        "schedule",
        f"{fields['pipeline_schedule']}, {stages} stages x {fields['virtual_stages']} virtual",
      ),
      (
        "micro-batches",
        f"{fields['micro_batches']} per data-parallel replica, in "
        f"{fields['pipeline_passes']} pass(es)",
      ),
      ("loop trips", f"{trips}, bubble {fields['bubble_fraction']:.1%}"),
    ],
  )


def measured_table(record) -> str:
  """One measured point (a records.points.MeasuredPoint)."""
  r = record
  rows = [
    ("experiment", f"{r.experiment} ({r.model}, {r.params:,} parameters)"),
    ("batch", f"{r.global_batch} x {r.seq_len} tokens"),
    ("compile", f"{r.compile_s:.2f} s (lowering {r.lower_s:.2f} s)"),
    (
      "step time",
      f"{r.step_time_s * 1e3:,.1f} ms median, "
      f"{r.step_time_p90_s * 1e3:,.1f} ms p90 over {r.timed_steps} steps",
    ),
    ("tokens/s", f"{r.tokens_per_s:,.0f} ({r.tokens_per_s_per_device:,.0f} per device)"),
    ("TFLOP/s per device", f"{r.model_tflops_per_device:.4f} model FLOPs"),
    ("MFU", f"{r.mfu:.1%} of {r.peak_tflops_per_device:.4f} TFLOP/s peak ({r.peak_source})"),
  ]
  if r.losses is not None:
    rows.append(("loss", f"{r.losses[0]:.3f} -> {r.losses[-1]:.3f}"))
  return "\n" + table.key_values(f"Result ({r.mode})", rows)


def projection_table(records: list) -> str:
  """Projected points (records.points.ProjectedPoint, or their JSON objects) of one
  experiment."""
  records = [to_json(r) for r in records]
  headers = (
    "hardware",
    "gpus",
    "nodes",
    " x ".join(mesh_lib.AXES),
    "step s",
    "tokens/s/GPU",
    "MFU",
    "memory GB",
    "compute s",
    "exposed comm s",
    "other s",
    "compiled for",
  )
  rows = []
  for r in records:
    # Records from before an axis existed lack it: size 1.
    mesh = " x ".join(str(r["mesh"].get(a, 1)) for a in mesh_lib.AXES)
    memory = f"{r['memory_per_gpu_gb']:.1f} / {r['hbm_capacity_gb']:.0f}"
    if r["fits"]:
      b = r["breakdown"]
      timing = (
        r["step_time_s"],
        f"{r['tokens_per_s_per_device']:,.0f}",
        mfu_text(r),
        memory,
        b["compute_s"],
        b["exposed_comm_s"],
        b["other_s"],
      )
    else:
      timing = (f"does not fit: {r['over_capacity_gb']:.1f} GB over", "", "", memory, "", "", "")
    rows.append((r["hardware"], r["devices"], r["nodes"], mesh, *timing, r["compile_target"]))
  if any("time_to_train_min" in r for r in records):
    headers += ("bubble s", "time to train min")
    rows = [
      (*row, r.get("breakdown", {}).get("bubble_s", ""), r.get("time_to_train_min", ""))
      for row, r in zip(rows, records)
    ]
  first = records[0]
  lines = [
    f"\n{first['experiment']}: {first['model']}, global batch {first['global_batch']} x "
    f"{first['seq_len']} tokens, {first['compute_dtype']}, remat {first['remat']}",
    table.columns(headers, rows),
  ]
  for note in sorted({r["compile_note"] for r in records if r["compile_note"]}):
    lines.append(f"note: compiled on host CPU devices: {note}")
  if any(r.get("compile_cached") for r in records):
    lines.append(
      "note: compiled programs read from the compile cache (projection/disk_cache.py; "
      "JAX_SCALING_COMPILE_CACHE=off compiles anew)"
    )
  return "\n".join(lines)


def search_table(exp, found, wall_s: float, top: int) -> str:
  """One point's search (`found`, projection/search.py's Result): what was pruned and why,
  and the `top` best projected."""
  ranking = found.ranking
  pruned = sum(ranking.pruned.values())
  lines = [
    f"\n{exp.name}: {exp.model.name} on {found.gpus} {found.hardware}, global batch "
    f"{exp.train.global_batch} x {exp.model.seq_len} tokens; searched in {wall_s:.0f} s",
    f"{ranking.candidates:,} configurations, {pruned:,} pruned, "
    f"{len(ranking.survivors):,} valid; {len(found.records)} projected in prior order "
    f"({found.compiles} new compiles)",
  ]
  for reason, count in ranking.pruned.items():
    lines.append(f"  pruned {count:>6,}: {reason} (e.g. {ranking.examples[reason]})")
  best = [to_json(r) for r in found.best(top)]
  if not (best and best[0]["fits"]):
    lines.append(f"none of the {len(found.records)} projected fits; the least over capacity:")
  headers = [
    "TP",
    "CP",
    "PP",
    "VS",
    "micro-batch",
    "schedule",
    "remat",
    "data",
    "step s",
    "GB/GPU",
    "MFU",
    "prior rank",
  ]
  has_ttt = any("time_to_train_min" in r for r in best)
  if has_ttt:
    headers.insert(-1, "time to train min")
  has_ep = any("expert_parallel" in r["search"] for r in best)  # a mixture of experts
  if has_ep:
    headers.insert(1, "EP")
  rows = []
  for r in best:
    s = r["search"]
    memory = f"{r['memory_per_gpu_gb']:.1f} / {r['hbm_capacity_gb']:.0f}"
    step = r["step_time_s"] if r["fits"] else f"does not fit: {r['over_capacity_gb']:.1f} GB over"
    mfu = mfu_text(r) if r["fits"] else ""
    row = [
      s["tensor_parallel"],
      s.get("context_parallel", 1),
      s["pipeline_parallel"],
      s["virtual_stages"],
      s["micro_batch"],
      s["schedule"],
      s["remat"],
      r["mesh"]["data"],
      step,
      memory,
      mfu,
      s["prior_rank"],
    ]
    if has_ttt:
      row.insert(-1, r.get("time_to_train_min", ""))
    if has_ep:
      row.insert(1, s.get("expert_parallel", 1))
    rows.append(row)
  lines.append(table.columns(headers, rows))
  lines.append(f"best: --set {' --set '.join(best[0]['search']['set'])}")
  return "\n".join(lines)


def configuration_text(record: dict) -> str:
  """A searched sweep point's configuration (its `search` entry) in short, as "TP4 PP16
  VS6 mb2 1f1b full"; "" for a point that was not searched."""
  s = record.get("search")
  if not s:
    return ""
  cp = f" CP{s['context_parallel']}" if s.get("context_parallel", 1) > 1 else ""
  ep = f" EP{s['expert_parallel']}" if "expert_parallel" in s else ""
  return (
    f"TP{s['tensor_parallel']}{ep}{cp} PP{s['pipeline_parallel']} VS{s['virtual_stages']} "
    f"mb{s['micro_batch']} {s['schedule']} {s['remat']}"
  )


def headline_mfu(record: dict) -> tuple[float | None, str]:
  """(MFU, its label) against the peak of the precision the matmuls run in: a program
  with NVFP4 matmuls against the FP4 peak ("fp4"), with FP8 ones against the FP8 peak
  ("fp8"), else the bf16 peak ("")."""
  if record.get("mfu_fp4") is not None:
    return record["mfu_fp4"], " fp4"
  if record.get("mfu_fp8") is not None:
    return record["mfu_fp8"], " fp8"
  return record.get("mfu"), ""


def mfu_text(record: dict) -> str:
  value, label = headline_mfu(record)
  return "" if value is None else f"{value:.1%}{label}"
