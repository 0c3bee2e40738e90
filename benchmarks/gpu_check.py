"""The train step measured on this machine's GPU beside the projection of the same
compiled step onto that GPU's catalog entry: one command for a lent single-GPU machine.

The trace reader is measure/trace.py, each op's projected time projection/op_costs.py and
the projection of the measured program projection/project.py's of_program; the tables,
which serve only this check, stay beside it.

For each configuration in CONFIGS (each loads a different part of the cost model: a
matmul-bound GPT-3 1.3B, a small model whose attention scores go through HBM, full
remat, FP8) this
  1. measures the step as `launch.py --mode=benchmark --devices=1` does
     (parallelism/mesh.py, train/step.py, train/loop.py): compile time, median step, MFU;
  2. projects the program compiled for this very device onto `--hardware` (h200 by
     default) with the projection's HLO reader, cost model and record (projection/project.py's
     of_program: a records.points.ProjectedPoint, as every projection makes), as the host
     projection does for CPU devices: no deviceless target is needed. The step's text
     comes from compiling it once more, which JAX's compilation caches serve (the
     executable the measurement ran; a persistent cache is set up if none is);
  3. for one configuration (--trace), traces its last step with the JAX profiler
     (train/hooks.py's ProfileHook) and reads the time of every HLO op from the trace
     (measure/trace.py), to set the top kernels beside the projection's time for the
     same ops.

  python benchmarks/gpu_check.py --output_dir=gpu_check          # one GPU, ~5 minutes
  python benchmarks/gpu_check.py --dry_run --output_dir=/tmp/gc  # host CPU, tiny sizes

OUTPUT_DIR receives at most four files: gpu_check.jsonl (one record per configuration
and one of the kernels, appended), gpu_check.md (the tables of this run), trace.xplane.pb
(the traced step) and trace_hlo.txt.gz (its optimized HLO, to match ops offline). A
configuration that fails is recorded with its error and the others still run; the exit
code is then 1. Bad flags: one line on stderr, exit code 2. --dry_run runs everything
on one host CPU device with tiny models and projects onto `host` (this machine's
profile, measured and cached by measure/host_calibration.py) unless --hardware says
otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import gzip
import json
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
from errors import UserInputError  # noqa: E402
from experiments import overrides  # noqa: E402
from hardware.catalog import Hardware  # noqa: E402
from measure import host_calibration, rates  # noqa: E402
from measure.point import PointOptions, run_point  # noqa: E402
from measure.trace import TOP_KERNELS, compare_ops, read_trace  # noqa: E402
from model.flops import param_count, train_flops_per_token  # noqa: E402
from projection import hlo, project  # noqa: E402
from projection.op_costs import projected_ops  # noqa: E402
from projection.plan import plan  # noqa: E402
from records.points import ProjectedPoint, to_json  # noqa: E402
from train import hooks as hooks_lib  # noqa: E402
from train import loop  # noqa: E402
from train import step as train_step  # noqa: E402

GB = 1e9
# Every configuration runs on one device of the tiny experiment's mesh, synthetic tokens.
BASE_SETS = (
  "mesh.data=1",
  "mesh.fsdp=1",
  "mesh.tensor=1",
  "mesh.pipeline=1",
  "train.task=synthetic",
)
JSONL, MARKDOWN = "gpu_check.jsonl", "gpu_check.md"
TRACE_FILE, HLO_FILE = "trace.xplane.pb", "trace_hlo.txt.gz"
MAX_FILE_BYTES = 16 * 2**20  # what the device tool brings back per file
TARGET_ERROR = 0.25  # the project's closing-the-loop target (benchmarks/closing_the_loop.py)


@dataclasses.dataclass(frozen=True)
class Config:
  name: str
  exercises: str  # the part of the cost model it loads
  gpu_sets: tuple[str, ...]  # --set overrides on one GPU
  dry_sets: tuple[str, ...]  # the same shape of run, tiny, for --dry_run on a CPU
  # Added to either after a failure, for one more try: cuDNN attention that does not
  # compile or run here falls back to XLA's, at a batch whose scores fit.
  fallback_sets: tuple[str, ...] = ()


# GPT-3 sizes: Brown et al. 2020 (model/config.py). Each fits one 141 GB H200 with room
# to spare under JAX's default 75% preallocation: compiled deviceless for H200
# (projection/aot_compile.py compile_step) they take 43 (compute), 11 (memory), 53 (remat)
# and 42 GB (fp8) per device; the fallbacks 40 and 39 GB.
_XLA_ATTENTION = ("model.attention=xla", "train.global_batch=2")
CONFIGS = (
  Config(
    "compute",
    "matmul-bound: GPT-3 1.3B, bf16, cuDNN attention, 8 x 2048 tokens",
    ("model=gpt3-1.3b", "model.attention=cudnn", "train.global_batch=8"),
    ("model.d_model=128", "model.head_dim=32", "train.global_batch=8"),
    _XLA_ATTENTION,
  ),
  Config(
    "memory",
    "memory-bound-heavy: GPT-3 125M, attention scores through HBM (xla)",
    ("model=gpt3-125m", "train.global_batch=4"),
    ("model.seq_len=256", "train.global_batch=4"),
  ),
  Config(
    "remat",
    "remat full: GPT-3 2.7B, every layer's forward run twice",
    ("model=gpt3-2.7b", "remat=full", "train.global_batch=8"),
    ("remat=full", "model.num_layers=3", "train.global_batch=8"),
  ),
  Config(
    "fp8",
    "FP8 matmuls and their casts: GPT-3 1.3B, E4M3 / E5M2, current scaling",
    ("model=gpt3-1.3b", "model.attention=cudnn", "precision=fp8", "train.global_batch=8"),
    ("precision=fp8", "train.global_batch=8"),
    _XLA_ATTENTION,
  ),
  # Last, so the time budget drops it first. Llama 3.2 1B: Meta's shapes (model/config.py).
  Config(
    "llama",
    "grouped-query attention, SwiGLU, a 128K vocabulary: Llama 3.2 1B, bf16, "
    "cuDNN attention, 4 x 4096 tokens",
    ("model=llama3.2-1b", "model.attention=cudnn", "model.seq_len=4096", "train.global_batch=4"),
    ("model=llama3-tiny", "train.global_batch=8"),
    ("model.attention=xla", "train.global_batch=1"),
  ),
)
CONFIG_NAMES = tuple(c.name for c in CONFIGS)


class _Parser(argparse.ArgumentParser):
  """Bad flags: one line on stderr and exit code 2, as launch.py."""

  def error(self, message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = _Parser(description=__doc__.split("\n\n")[0])
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
    help="catalog entry to project onto (default: h200; host with --dry_run)",
  )
  parser.add_argument(
    "--only",
    default=",".join(CONFIG_NAMES),
    help="comma-separated configurations (default: %(default)s)",
  )
  parser.add_argument(
    "--trace",
    default="memory",
    help="the configuration whose last step is traced, or none (default: %(default)s)",
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
  if args.trace != "none" and args.trace not in CONFIG_NAMES:
    parser.error(
      f"--trace: {args.trace!r} is not a configuration; choose from "
      f"{', '.join(CONFIG_NAMES)} or none"
    )
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
  args.hardware = (args.hardware or ("host" if args.dry_run else "h200")).strip().lower()
  return args


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
  # One GPU is a node of its own (the catalog's entries describe 8-GPU nodes); it has no
  # collectives, but the program is costed through the same layout and timer all the same.
  alone = dataclasses.replace(hw, gpus_per_node=1, nvlink_domain_size=1)
  memory = compiled.memory_analysis()
  memory_bytes = (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
  )
  compiled_for = "cuda" if device.platform == "gpu" else device.platform
  point = project.of_program(
    exp, plan(exp, alone, 1), analysis, memory_bytes, compile_s, compiled_for
  )
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
      self.failure = f"{method}: {type(e).__name__}: {_first_line(e)}"

  def before_step(self, step: int) -> None:
    self._call("before_step", step)

  def after_step(self, step: int, metrics: dict, step_time_s: float) -> None:
    self._call("after_step", step, metrics, step_time_s)

  def close(self) -> None:
    self._call("close")


# ----------------------------------------------------------------------------------- report


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0] if text else ""


def _ms(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds * 1e3:,.2f}"


def _ratio(projected: float | None, measured: float) -> str:
  if projected is None or not measured > 0:
    return "-"
  return f"{projected / measured - 1:+.1%}"


def config_table(records: list[dict]) -> list[str]:
  lines = [
    "| configuration | model | batch x seq | remat | fp8 | compile s | measured step ms | "
    "measured MFU | projected step ms | projected MFU | error | compute ms | "
    "memory-bound ms | launches ms | exposed comm ms | memory GB |",
    "|" + "---|" * 16,
  ]
  for r in records:
    head = (
      f"| {r['config']} | {r['model']} | {r['global_batch']} x {r['seq_len']} | "
      f"{r['remat']} | {r['fp8']} |"
    )
    if "error" in r or "skipped" in r:
      lines.append(f"{head} {r.get('error') or r.get('skipped')} |" + " |" * 10)
      continue
    p = r["projected"]
    b = p["breakdown"]
    flag = "" if abs(p["step_time_s"] / r["step_time_s"] - 1) <= TARGET_ERROR else " *"
    lines.append(
      f"{head} {r['compile_s']:.1f} | {_ms(r['step_time_s'])} | {r['mfu']:.1%} | "
      f"{_ms(p['step_time_s'])} | {p['mfu']:.1%} | "
      f"{_ratio(p['step_time_s'], r['step_time_s'])}{flag} | {_ms(b['compute_s'])} | "
      f"{_ms(b['memory_bound_s'])} | {_ms(b['other_s'])} | {_ms(b['exposed_comm_s'])} | "
      f"{p['memory_per_gpu_gb']:.1f} / {p['hbm_capacity_gb']:.0f} |"
    )
  for r in records:
    if "first_attempt_error" in r:
      lines.append(
        f"\n{r['config']}: the first attempt failed ({r['first_attempt_error']}); "
        f"the row is the retry with {' '.join(r['fallback_sets'])}."
      )
  lines.append(
    f"\nerror: projected over measured median step, minus one; * misses the "
    f"{TARGET_ERROR:.0%} target. compute includes memory-bound (ops whose HBM "
    f"bytes outlast their FLOPs); launches: the cost model's per-kernel overhead."
  )
  return lines


def kernel_table(kernels: dict) -> list[str]:
  lines = [
    f"Trace of one `{kernels['config']}` step ({kernels['source']}): {kernels['events']} op "
    f"events, {kernels['ops']} ops, {kernels['matched_ops']} of them matched to the "
    f"{kernels['projected_ops']} ops of the projected program.",
    "",
    f"- traced step {_ms(kernels['traced_step_s'])} ms: matched ops "
    f"{_ms(kernels['measured_matched_s'])} ms (projected "
    f"{_ms(kernels['projected_matched_s'])} ms), unmatched "
    f"{_ms(kernels['measured_unmatched_s'])} ms, not in any op "
    f"{_ms(kernels['measured_idle_s'])} ms (projected launches "
    f"{_ms(kernels['projected_launch_s'])} ms)",
    "",
    "| # | HLO op | opcode / kind | bound | runs | measured ms | projected ms | error | from |",
    "|" + "---|" * 9,
  ]
  for i, row in enumerate(kernels["top"], 1):
    kind = f"{row['opcode']} {row['kind']}".strip() or "-"
    runs = (
      f"{row['measured_runs']}"
      if row["projected_runs"] is None
      else f"{row['measured_runs']} / {row['projected_runs']}"
    )
    source = row["op_name"][-60:] if row["op_name"] else "-"
    lines.append(
      f"| {i} | {row['op']} | {kind} | {row['bound'] or '-'} | {runs} | "
      f"{_ms(row['measured_s'])} | {_ms(row['projected_s'])} | "
      f"{_ratio(row['projected_s'], row['measured_s'])} | {source} |"
    )
  lines.append(
    "\nruns: events in the trace / executions the program makes (loop trips "
    "counted); projected ms leaves out the per-kernel launch overhead."
  )
  return lines


def write_markdown(
  path: str, header: list[str], records: list[dict], kernels: dict | None, trace_note: str
) -> None:
  lines = [*header, "", *config_table(records), ""]
  if kernels:
    lines += kernel_table(kernels)
  elif trace_note:
    lines.append(f"Trace: {trace_note}")
  partial = f"{path}.partial"
  with open(partial, "w") as f:
    f.write("\n".join(lines) + "\n")
  os.replace(partial, path)  # a reader sees the last whole table


def append_jsonl(path: str, record: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def _copy_small(source: str, target: str) -> str:
  if os.path.getsize(source) > MAX_FILE_BYTES:
    return f"{os.path.basename(source)} is {os.path.getsize(source) / 2**20:.0f} MiB: not copied"
  shutil.copyfile(source, target)
  return ""


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
  records, kernels, trace_note, failed = [], None, "", []
  scratch = tempfile.mkdtemp(prefix="gpu-check-trace-")
  try:
    for config in (c for c in CONFIGS if c.name in args.only):
      trace_dir = os.path.join(scratch, config.name) if config.name == args.trace else None
      record, projection, times = _attempt(config, args, device, hw, trace_dir, started)
      if "error" in record:
        failed.append(config.name)
      elif trace_dir and record.get("trace_failure"):
        trace_note = f"not traced: {record['trace_failure']}"
      elif trace_dir and projection is not None:
        kernels, trace_note = _trace_record(
          config, trace_dir, projection, hw, times, args.output_dir
        )
        if kernels:
          append_jsonl(jsonl, kernels)
      record["time"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
      append_jsonl(jsonl, record)
      records.append(record)
      _print_progress(record)
      write_markdown(markdown, header, records, kernels, trace_note)
      gc.collect()  # the last configuration's state leaves the device before the next
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  if args.trace != "none" and args.trace not in args.only:
    print(f"note: --trace={args.trace} is not among --only: nothing traced")
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
      errors.append(f"{type(e).__name__}: {_first_line(e)}"[:300])
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
  output_dir: str,
) -> tuple[dict | None, str]:
  trace, note, xplane = read_trace(trace_dir)
  notes = [note] if note else []
  if xplane:
    copied = _copy_small(xplane, os.path.join(output_dir, TRACE_FILE))
    notes += [copied] if copied else []
  with gzip.open(os.path.join(output_dir, HLO_FILE), "wt") as f:
    f.write(projection.hlo_text)
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
    f"{_ms(record['step_time_s'])} ms measured, {_ms(p['step_time_s'])} ms projected "
    f"({_ratio(p['step_time_s'], record['step_time_s'])}), MFU {record['mfu']:.1%}",
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
