"""Run a sweep point by point, appending each result as it finishes; resume by skipping.

Every point gets a key: experiment, mode, scaling, hardware, device count and a
fingerprint of the experiment's configuration (after `--set`), so a sweep started again
on the same directory skips the points whose records are there, and a sweep of another
configuration does not. Points that cannot run (the mesh does not divide the count, the
batch does not divide over the replicas, the model does not fit) are recorded with the
reason and count as done; a point that fails unexpectedly is recorded as failed and is
tried again next time.
"""

import dataclasses
import datetime
import hashlib
import sys
from collections.abc import Callable

import tqdm

from errors import UserInputError
from measure import fit, host_calibration
from measure.point import PointOptions, run_point
from parallelism import mesh as mesh_lib
from projection import layout, project, search
from projection.plan import plan
from records.points import MeasuredPoint, ProjectedPoint, SearchProjected
from records.sweeps import SweepLabels, SweepRecord
from report import results
from sweep import metrics
from sweep.definitions import Sweep

# device count -> the experiment configuration that count runs.
AtTarget = Callable[[str, int], object]  # (hardware, devices) -> experiment


@dataclasses.dataclass(frozen=True)
class Point:
  scaling: str
  hardware: str  # a generation (project) or the platform (benchmark)
  devices: int


def config_fingerprint(exp) -> str:
  """Short, stable hash of the whole experiment configuration (frozen dataclasses)."""
  return hashlib.sha1(repr(exp).encode()).hexdigest()[:10]


def points(sweep: Sweep, platform: str) -> list[Point]:
  """In the order they run: by hardware first, so that one generation's points share
  one compile, then by scaling rule, then by ascending count (baselines first)."""
  hardware = sweep.hardware if sweep.mode == "project" else (platform,)
  return [Point(s, h, n) for h in hardware for s in sweep.scalings for n in sorted(sweep.counts)]


def point_key(exp, sweep: Sweep, point: Point, full_compile: bool = False) -> str:
  """`full_compile` points get keys of their own: composed records do not stand in for
  them (a full compile's record stands in for a composed one, its reference); so do a
  searched sweep's, by its budget."""
  searched = f"/best-of-{sweep.search_budget}" if sweep.search_budget else ""
  return (
    f"{exp.name}/{sweep.mode}/{point.scaling}/{point.hardware}/{point.devices}/"
    f"{config_fingerprint(exp)}{searched}{'/full' if full_compile else ''}"
  )


def _replicas(exp, sweep: Sweep, point: Point) -> int:
  """Data-parallel replicas (data x fsdp) of the experiment's mesh at this point."""
  if sweep.mode == "project":
    hw = host_calibration.hardware(point.hardware, point.devices)
    sizes = layout.target_layout(
      exp.mesh, point.devices, hw.gpus_per_node, hw.nvlink_domain_size
    ).sizes
  else:
    sizes = mesh_lib.plan(exp.mesh, point.devices).sizes
  return sizes["data"] * sizes["fsdp"]


def point_experiment(base, exp, sweep: Sweep, point: Point):
  """`exp` (the configuration at this count) with the scaling rule's global batch:
  strong, `base`'s at every count; weak, a fixed number per replica; configured, `exp`'s."""
  if point.scaling == "configured":
    return exp
  if point.scaling == "strong":
    batch = base.train.global_batch
  else:
    batch = sweep.weak_sequences_per_replica * _replicas(exp, sweep, point)
  return dataclasses.replace(exp, train=dataclasses.replace(exp.train, global_batch=batch))


def _measure(exp, devices: int, options: PointOptions) -> MeasuredPoint:
  """A benchmark-mode measured point on the first `devices` local devices."""
  measured = run_point(exp, "benchmark", fit.devices(devices), options).record
  if measured is None:  # only when --checkpoint_dir already holds the run's last step
    raise RuntimeError(
      f"no steps left to time: the checkpoint in {options.checkpoint_dir} is at the run's last step"
    )
  return measured


def _best_of_search(exp, sweep: Sweep, point: Point, how: str) -> ProjectedPoint:
  """The projection of the best configuration at `point` (the least over capacity if none
  fits) of `exp`'s own and the search's first `sweep.search_budget`; its `search` entry
  says which it is, and `projected` what else was projected and how fast."""
  found = search.search(
    exp,
    host_calibration.hardware(point.hardware, point.devices),
    point.devices,
    sweep.search_budget,
    how,
    include=search.candidate_of(exp),
  )
  best = found.best(1)[0]
  projected = [
    SearchProjected(r.search.set, r.search.included, r.fits, r.step_time_s, r.memory_per_gpu_gb)
    for r in found.records
  ]
  choice = dataclasses.replace(best.search, projected=projected)
  return dataclasses.replace(best, search=choice)


def _run_point(
  base,
  at_target: AtTarget,
  sweep: Sweep,
  point: Point,
  options: PointOptions,
  full_compile: bool,
) -> tuple[str, ProjectedPoint | MeasuredPoint | None, str | None]:
  """The point's status, and its record (it ran) or the reason it did not."""
  try:
    point_exp = point_experiment(base, at_target(point.hardware, point.devices), sweep, point)
    how = "full" if full_compile else "auto"
    if sweep.mode == "project" and sweep.search_budget:
      record = _best_of_search(point_exp, sweep, point, how)
    elif sweep.mode == "project":
      hw = host_calibration.hardware(point.hardware, point.devices)
      record = project.project(point_exp, plan(point_exp, hw, point.devices), how)
    else:
      record = _measure(point_exp, point.devices, options)
  except UserInputError as e:
    return "cannot_run", None, str(e)
  except Exception as e:  # pylint: disable=broad-except
    # Recorded and retried on the next run rather than losing the points after it.
    return "failed", None, f"{type(e).__name__}: {e}"
  return ("ok" if getattr(record, "fits", True) else "does_not_fit"), record, None


def _labels(exp, sweep: Sweep, key: str, point: Point) -> SweepLabels:
  """What every sweep record carries, whatever its status."""
  return SweepLabels(
    sweep=exp.name,
    sweep_key=key,
    sweep_config=config_fingerprint(exp),
    sweep_mode=sweep.mode,
    scaling=point.scaling,
    hardware=point.hardware,
    devices=point.devices,
    time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  )


def run(
  exp,
  sweep: Sweep,
  output_dir: str,
  platform: str,
  at_target: AtTarget | None = None,
  options: PointOptions | None = None,
  full_compile: bool = False,
) -> list[dict]:
  """Run the points not yet in `output_dir`; return every record of this sweep.

  `exp` names the sweep and fingerprints its configuration; `at_target(hardware, n)` is
  the experiment as n devices of that hardware run it (default: `exp` everywhere); a
  measured point runs with `options` (default: TensorBoard scalars in `output_dir`). A
  projected point is projected `how="auto"` (projection/project.py: a 1f1b point composed
  from cached pieces) or, with `full_compile`, `how="full"`; a searched sweep's point is
  the best its search projects (each candidate projected the same way).
  """
  at_target = at_target or (lambda _hardware, _devices: exp)
  options = options or PointOptions(output_dir=output_dir)
  keyed = {point_key(exp, sweep, p, full_compile): p for p in points(sweep, platform)}
  # results.read skips (with a warning) lines that are not records; a record of another
  # shape (a hand edit, another tool) is not this sweep's.
  done = {
    r["sweep_key"]: r
    for r in results.read(output_dir)
    if isinstance(r.get("sweep_key"), str)
    and r["sweep_key"] in keyed
    and r.get("status") not in ("failed", None)
  }
  todo = [k for k in keyed if k not in done]
  if done:
    print(f"{len(done)} of {len(keyed)} points already in {output_dir}: skipped")
  baselines = {}
  for key in keyed:  # in run order, so the first "ok" point of a series is its baseline
    if key in done and done[key]["status"] == "ok":
      baselines.setdefault(metrics.series_key(done[key]), done[key])
  progress = tqdm.tqdm(
    todo, desc=f"sweep {exp.name}", unit="point", disable=not todo, file=sys.stdout
  )
  try:
    for key in progress:
      point = keyed[key]
      progress.set_postfix_str(f"{point.scaling} {point.hardware} x {point.devices}")
      status, ran, reason = _run_point(exp, at_target, sweep, point, options, full_compile)
      typed = SweepRecord(status, _labels(exp, sweep, key, point), exp.name, ran, reason)
      if status == "failed":
        progress.write(f"point {key} failed: {reason}")
      record = typed.to_json()
      series = metrics.series_key(record)
      if status == "ok":
        scaling = metrics.scaling(record, baselines.get(series), sweep)
        record = dataclasses.replace(typed, scaling=scaling).to_json()
        baselines.setdefault(series, record)
      results.append(output_dir, record)
      done[key] = record
  except KeyboardInterrupt:
    progress.close()
    print(
      f"\ninterrupted: {len(done)} of {len(keyed)} points are in {output_dir}; the same "
      "command runs the rest",
      file=sys.stderr,
    )
    sys.exit(130)
  progress.close()
  return [done[k] for k in keyed]
