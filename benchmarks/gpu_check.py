"""The train step measured on this machine's GPU beside the projection of the same
compiled step onto that GPU's catalog entry: one command for a lent single-GPU machine.

For each configuration in CONFIGS (benchmarks/gpu_check_configs.py; each loads a part of
the cost model: matmuls, attention through HBM, full remat, FP8, experts, grouped-query
attention) this
  1. measures the step as `launch.py --mode=benchmark --devices=1` does
     (parallelism/mesh.py, train/step.py, train/loop.py): compile time, median step, MFU;
  2. projects the program compiled for this very device onto `--hardware` (by default the
     catalog entry the GPU's name names) with the projection's HLO reader, cost model and
     record (projection/project.py's of_program: a records.points.ProjectedPoint, as every
     projection makes), as the host projection does for CPU devices: no deviceless target
     is needed. The step's text comes from compiling it once more, which JAX's compilation
     caches serve (the executable the measurement ran; a persistent cache is set up if
     none is);
  3. for the configurations --trace names (all by default), traces the last step with the
     JAX profiler and reads the time of every HLO op, or of every kernel by class, from the
     trace (measure/trace.py), to set them beside the projection's time for the same ops
     (projection/op_costs.py).
The tables and files: benchmarks/gpu_check_report.py.

  python benchmarks/gpu_check.py --output_dir=gpu_check          # one GPU, ~4 minutes
  python benchmarks/gpu_check.py --dry_run --output_dir=/tmp/gc  # host CPU, tiny sizes

OUTPUT_DIR receives at most four files: gpu_check.jsonl (one record per configuration
and one per traced step, appended), gpu_check.md (the tables of this run),
trace.xplane.pb (the first traced step) and hlo.tar.gz (every configuration's optimized
HLO, to match ops offline). A configuration that fails is recorded with its error and the
others still run; the exit code is then 1. Bad flags: one line on stderr, exit code 2.
--dry_run runs everything on one host CPU device with tiny models and projects onto
`host` (this machine's profile, measured and cached by measure/host_calibration.py)
unless --hardware says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import platform_env  # noqa: E402

if __name__ == "__main__":
  if "--dry_run" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"  # a dry run on a GPU machine stays on its CPU
  platform_env.configure(1)

# pylint: disable=wrong-import-position
import jax  # noqa: E402

import experiments  # noqa: E402
from benchmarks.gpu_check_configs import BASE_SETS, CONFIG_NAMES, CONFIGS, Config  # noqa: E402
from benchmarks.gpu_check_report import (  # noqa: E402
  append_jsonl,
  copy_small,
  first_line,
  ms,
  ratio,
  write_markdown,
  write_programs,
)
from errors import UserInputError  # noqa: E402
from experiments import overrides  # noqa: E402
from hardware import catalog  # noqa: E402
from hardware.catalog import Hardware  # noqa: E402
from measure import host_calibration, rates  # noqa: E402
from measure.point import PointOptions, run_point  # noqa: E402
from measure.trace import TOP_KERNELS, compare_ops, read_trace  # noqa: E402
from model.flops import param_count, train_flops_per_token  # noqa: E402
from projection import hlo, project  # noqa: E402
from projection.op_costs import projected_ops  # noqa: E402
from projection.plan import Target, plan  # noqa: E402
from records.points import ProjectedPoint, to_json  # noqa: E402
from train import hooks as hooks_lib  # noqa: E402
from train import loop  # noqa: E402
from train import step as train_step  # noqa: E402

JSONL, MARKDOWN = "gpu_check.jsonl", "gpu_check.md"
# The first traced configuration's trace; every measured configuration's optimized HLO.
TRACE_FILE, HLO_FILE = "trace.xplane.pb", "hlo.tar.gz"


class Parser(argparse.ArgumentParser):
  """Bad flags: one line on stderr and exit code 2, as launch.py (the GPU checks' scripts)."""

  def error(self, message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = Parser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--output_dir",
    default=os.path.join("runs", "gpu_check"),
    help="where the results go (default: %(default)s)",
  )
  parser.add_argument(
    "--dry_run", action="store_true", help="host CPU, tiny sizes: the same code path end to end"
  )
  parser.add_argument(
    "--hardware",
    default=None,
    help="catalog entry to project onto (default: the catalog entry this GPU's name names, "
    "h200 if none; host with --dry_run)",
  )
  parser.add_argument(
    "--only",
    default=",".join(CONFIG_NAMES),
    help="comma-separated configurations (default: %(default)s)",
  )
  parser.add_argument(
    "--trace",
    default="all",
    help="comma-separated configurations whose last step is traced, all or none "
    "(default: %(default)s)",
  )
  parser.add_argument("--steps", type=int, default=8, help="timed steps (default: %(default)s)")
  parser.add_argument(
    "--warmup_steps", type=int, default=2, help="untimed steps first (default: %(default)s)"
  )
  parser.add_argument(
    "--budget_s",
    type=float,
    default=300.0,
    help="no configuration starts after this many seconds (default: %(default)s)",
  )
  args = parser.parse_args(argv)
  args.only = [n.strip() for n in args.only.split(",") if n.strip()]
  unknown = [n for n in args.only if n not in CONFIG_NAMES]
  if unknown or not args.only:
    parser.error(
      f"--only: unknown configuration {', '.join(unknown) or '(none given)'}; "
      f"choose from {', '.join(CONFIG_NAMES)}"
    )
  named = {"all": list(CONFIG_NAMES), "none": []}.get(args.trace.strip())
  if named is None:
    named = [n.strip() for n in args.trace.split(",") if n.strip()]
    unknown = [n for n in named if n not in CONFIG_NAMES]
    if unknown or not named:
      parser.error(
        f"--trace: {', '.join(unknown) or '(none given)'} is not a configuration; choose "
        f"from {', '.join(CONFIG_NAMES)}, all or none"
      )
  args.trace = named
  if args.steps < 1:
    parser.error(f"--steps must be at least 1, got {args.steps}")
  if args.warmup_steps < 0:
    parser.error(f"--warmup_steps must be at least 0, got {args.warmup_steps}")
  if not args.budget_s > 0:
    parser.error(f"--budget_s must be positive, got {args.budget_s}")
  if not args.output_dir.strip():
    parser.error("--output_dir: empty; name a directory")
  if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
    parser.error(f"--output_dir {args.output_dir} is a file, not a directory")
  args.hardware = args.hardware and args.hardware.strip().lower()
  return args


def catalog_entry_for(device_kind: str) -> str:
  """The catalog entry a GPU's name names ("NVIDIA H100 80GB HBM3": h100), h200 if none;
  the longest name first, so that a GB200 is not read as a B200."""
  for name in sorted(catalog.names(), key=len, reverse=True):
    if name.upper() in device_kind.upper():
      return name
  return "h200"


def experiment(
  config: Config, dry_run: bool, steps: int, warmup_steps: int, extra_sets: tuple[str, ...] = ()
) -> experiments.ExperimentConfig:
  sets = (
    *BASE_SETS,
    *(config.dry_sets if dry_run else config.gpu_sets),
    *extra_sets,
    f"train.steps={steps}",
    f"train.warmup_steps={warmup_steps}",
  )
  exp = overrides.apply(experiments.load("tiny"), list(sets))
  exp.model.validate()
  exp.train.validate()
  return exp


# ---------------------------------------------------------------------------------- measure


def measure(
  exp: experiments.ExperimentConfig, device, hooks: tuple = ()
) -> tuple[loop.RunResult, train_step.TrainProgram]:
  """The run `launch.py --mode=benchmark --devices=1` times (its run_point), on `device`."""
  options = PointOptions(output_dir=None, hooks=tuple(hooks))
  point = run_point(exp, "benchmark", [device], options)
  return point.result, point.program


def peak_tflops(hw: Hardware) -> tuple[float, str]:
  """The MFU denominator for measured and projected steps alike: dense BF16 peak, as
  launch.py quotes GPU MFU (a host profile's best measured bf16 matmul on a CPU)."""
  return hw.peak_tflops("bf16"), f"{hw.name} dense BF16 peak"


# ---------------------------------------------------------------------------------- project


@dataclasses.dataclass(frozen=True)
class Projection:
  point: ProjectedPoint
  program: hlo.Program
  hlo_text: str
  hlo_bytes: float  # the program's HBM bytes over one step (loop trips counted)
  kernels: int  # compute ops run over one step


def one_gpu(exp: experiments.ExperimentConfig, hw: Hardware) -> Target:
  """`exp` planned on one GPU of `hw`. One GPU is a node of its own (the catalog's entries
  describe 8-GPU nodes); it has no collectives, but the program is costed through the same
  layout and timer all the same."""
  return plan(exp, dataclasses.replace(hw, gpus_per_node=1, nvlink_domain_size=1), 1)


def project_compiled(
  exp: experiments.ExperimentConfig, program: train_step.TrainProgram, hw: Hardware, device
) -> Projection:
  """The projection of the step as compiled for this device (the one `measure` ran):
  projection/project.py's of_program, without its deviceless compile."""
  start = time.perf_counter()
  compiled = program.lower(exp.train.global_batch, exp.model.seq_len).compile()
  compile_s = time.perf_counter() - start
  text = compiled.as_text()
  analysis = hlo.analyze(text)
  compute = [(n, t) for n, t in hlo.walk(analysis) if isinstance(n, hlo.Compute)]
  memory = compiled.memory_analysis()
  memory_bytes = (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
  )
  compiled_for = "cuda" if device.platform == "gpu" else device.platform
  point = project.of_program(exp, one_gpu(exp, hw), analysis, memory_bytes, compile_s, compiled_for)
  return Projection(
    point,
    analysis,
    text,
    sum((n.bytes_read + n.bytes_written) * t for n, t in compute),
    sum(t for _, t in compute),
  )


class _Guarded:
  """A step hook whose failure (a profiler that cannot start here) is noted, not raised:
  the trace is an extra, the measurement is not."""

  def __init__(self, hook: hooks_lib.StepHook):
    self._hook, self.failure = hook, ""

  def _call(self, method: str, *args) -> None:
    if self.failure:
      return
    try:
      getattr(self._hook, method)(*args)
    except Exception as e:  # pylint: disable=broad-except
      self.failure = f"{method}: {type(e).__name__}: {first_line(e)}"

  def before_step(self, step: int) -> None:
    self._call("before_step", step)

  def after_step(self, step: int, metrics: dict, step_time_s: float) -> None:
    self._call("after_step", step, metrics, step_time_s)

  def close(self) -> None:
    self._call("close")


# ------------------------------------------------------------------------------------- main


def _use_compilation_cache() -> None:
  """JAX's persistent compilation cache, so that the projection's second compile of each
  step is read back rather than redone (a cache already configured is kept)."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="gpu-check-xla-"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _device(dry_run: bool):
  if dry_run:
    return jax.devices("cpu")[0]
  device = jax.devices()[0]
  if device.platform != "gpu":
    raise UserInputError(
      f"no GPU here (jax {jax.__version__} sees {device.platform} "
      f"devices); run with --dry_run on a CPU machine"
    )
  return device


def run_config(
  config: Config,
  args: argparse.Namespace,
  device,
  hw: Hardware,
  trace_dir: str | None,
  extra_sets: tuple[str, ...] = (),
) -> tuple[dict, Projection, list[float]]:
  exp = experiment(config, args.dry_run, args.steps, args.warmup_steps, extra_sets)
  record = {
    "kind": "config",
    "config": config.name,
    "exercises": config.exercises,
    "dry_run": args.dry_run,
    "model": exp.model.name,
    "params": param_count(exp.model),
    "num_layers": exp.model.num_layers,
    "d_model": exp.model.d_model,
    "global_batch": exp.train.global_batch,
    "seq_len": exp.model.seq_len,
    "compute_dtype": exp.model.compute_dtype,
    "attention": exp.model.attention,
    "remat": exp.model.remat,
    "fp8": exp.model.fp8,
    "timed_steps": exp.train.steps,
    "platform": device.platform,
    "device_kind": device.device_kind,
    "jax_version": jax.__version__,
  }
  total = exp.train.warmup_steps + exp.train.steps
  hooks = (_Guarded(hooks_lib.ProfileHook(trace_dir, total - 1, total)),) if trace_dir else ()
  run, program = measure(exp, device, hooks)
  if hooks and hooks[0].failure:
    record["trace_failure"] = hooks[0].failure
  times = list(run.step_times_s)
  if trace_dir and len(times) > 1:  # the traced step is slowed by tracing: not in the median
    run = dataclasses.replace(run, step_times_s=times[:-1])
  tokens_per_step = exp.train.global_batch * exp.model.seq_len
  peak, peak_source = peak_tflops(hw)
  record.update(rates.summarize(run, tokens_per_step, 1, train_flops_per_token(exp.model), peak))
  record.update(
    peak_source=peak_source, step_times_s=times, final_loss=run.losses[-1] if run.losses else None
  )
  projection = project_compiled(exp, program, hw, device)
  record["projected"] = to_json(projection.point)
  record["projected_program"] = {"hlo_bytes": projection.hlo_bytes, "kernels": projection.kernels}
  record["error_vs_measured"] = projection.point.step_time_s / record["step_time_s"] - 1
  return record, projection, times


def main(argv: list[str]) -> int:
  args = parse_args(argv)
  started = time.perf_counter()
  device = _device(args.dry_run)
  if not args.hardware:
    args.hardware = "host" if args.dry_run else catalog_entry_for(device.device_kind)
  hw = host_calibration.hardware(args.hardware, 1)
  if not args.dry_run and hw.name.upper() not in device.device_kind.upper():
    print(f"note: projecting onto {hw.name} while this device is {device.device_kind}")
  _use_compilation_cache()
  os.makedirs(args.output_dir, exist_ok=True)
  jsonl, markdown = (os.path.join(args.output_dir, n) for n in (JSONL, MARKDOWN))
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  header = [
    f"# gpu_check {'dry run ' if args.dry_run else ''}{stamp}",
    "",
    f"{device.device_kind} ({device.platform}), jax {jax.__version__}; projected onto "
    f"`{hw.name}` x 1 ({hw.description}) from the program compiled for this device; "
    f"{args.steps} timed steps after {args.warmup_steps} warm-up, median.",
  ]
  print("\n".join(header[2:]), flush=True)
  records, traced, failed = [], [], []
  programs: dict[str, str] = {}  # configuration -> its optimized HLO, into HLO_FILE
  scratch = tempfile.mkdtemp(prefix="gpu-check-trace-")
  try:
    for config in (c for c in CONFIGS if c.name in args.only):
      trace_dir = os.path.join(scratch, config.name) if config.name in args.trace else None
      record, projection, times = _attempt(config, args, device, hw, trace_dir, started)
      if projection is not None:
        programs[config.name] = projection.hlo_text
        write_programs(os.path.join(args.output_dir, HLO_FILE), programs)
      if "error" in record:
        failed.append(config.name)
      elif trace_dir and record.get("trace_failure"):
        traced.append((config.name, None, f"not traced: {record['trace_failure']}"))
      elif trace_dir and projection is not None:
        # The first trace is kept whole; the others as their op tables.
        keep = None if any(k for _, k, _ in traced) else args.output_dir
        kernels, note = _trace_record(config, trace_dir, projection, hw, times, keep)
        traced.append((config.name, kernels, note))
        if kernels:
          append_jsonl(jsonl, kernels)
      record["time"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
      append_jsonl(jsonl, record)
      records.append(record)
      _print_progress(record)
      write_markdown(markdown, header, records, traced)
      gc.collect()  # the last configuration's state leaves the device before the next
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  if args.trace and not set(args.trace) & set(args.only):
    print(f"note: --trace={','.join(args.trace)} is not among --only: nothing traced")
  print()
  with open(markdown) as f:
    print(f.read())
  print(f"appended to {jsonl}; tables in {markdown} ({time.perf_counter() - started:.0f} s in all)")
  if failed:
    print(
      f"error: {len(failed)} configuration(s) failed: {', '.join(failed)} (the reasons "
      f"are in {jsonl})",
      file=sys.stderr,
    )
    return 1
  return 0


def _attempt(
  config: Config,
  args: argparse.Namespace,
  device,
  hw: Hardware,
  trace_dir: str | None,
  started: float,
) -> tuple[dict, Projection | None, list]:
  """One configuration's record; after a failure, once more with its fallback overrides
  (the first error kept), unless the time budget is spent. A failure is recorded, not
  raised: the other configurations still run."""
  errors, sets = [], ()
  for fallback in (False, True):
    if fallback:
      if not config.fallback_sets:
        break
      sets = config.fallback_sets
    elapsed = time.perf_counter() - started
    if elapsed > args.budget_s:
      errors.append(f"skipped: {elapsed:.0f} s of the {args.budget_s:.0f} s budget spent")
      break
    try:
      record, projection, times = run_config(config, args, device, hw, trace_dir, sets)
    except UserInputError:
      raise
    except Exception as e:  # pylint: disable=broad-except (recorded; the others still run)
      errors.append(f"{type(e).__name__}: {first_line(e)}"[:300])
      if trace_dir:
        shutil.rmtree(trace_dir, ignore_errors=True)  # a failed attempt's partial trace
      gc.collect()  # an out-of-memory attempt's buffers go before the next
      continue
    if errors:
      record.update(fallback_sets=list(sets), first_attempt_error=errors[0])
    return record, projection, times
  exp = experiment(config, args.dry_run, args.steps, args.warmup_steps, sets)
  record = {
    "kind": "config",
    "config": config.name,
    "model": exp.model.name,
    "global_batch": exp.train.global_batch,
    "seq_len": exp.model.seq_len,
    "remat": exp.model.remat,
    "fp8": exp.model.fp8,
  }
  if errors and errors[-1].startswith("skipped:") and len(errors) == 1:
    record["skipped"] = errors[0]
  else:
    record["error"] = "; then ".join(errors)
  return record, None, []


def _trace_record(
  config: Config,
  trace_dir: str,
  projection: Projection,
  hw: Hardware,
  times: list[float],
  output_dir: str | None,
) -> tuple[dict | None, str]:
  """The traced step's ops beside the projection's; its trace file copied to `output_dir`
  (none: not kept)."""
  trace, note, xplane = read_trace(trace_dir)
  notes = [note] if note else []
  if xplane and output_dir:
    copied = copy_small(xplane, os.path.join(output_dir, TRACE_FILE))
    notes += [copied] if copied else [f"kept as {TRACE_FILE}"]
  if trace is None:
    return None, "; ".join(notes)
  kernels = compare_ops(trace, projected_ops(projection.program, hw), times[-1], TOP_KERNELS)
  kernels.update(
    kind="kernels",
    config=config.name,
    projected_launch_s=projection.point.breakdown["other_s"],
    notes=notes,
  )
  return kernels, "; ".join(notes)


def _print_progress(record: dict) -> None:
  if "error" in record or "skipped" in record:
    print(f"  {record['config']}: {record.get('error') or record.get('skipped')}", flush=True)
    return
  p = record["projected"]
  print(
    f"  {record['config']}: compile {record['compile_s']:.1f} s, step "
    f"{ms(record['step_time_s'])} ms measured, {ms(p['step_time_s'])} ms projected "
    f"({ratio(p['step_time_s'], record['step_time_s'])}), MFU {record['mfu']:.1%}",
    flush=True,
  )


def cli(argv: list[str]) -> int:
  """main() with bad input as one line on stderr and exit code 2."""
  try:
    return main(argv)
  except UserInputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(cli(sys.argv[1:]))
