"""Run an experiment: build its mesh and model, then train or benchmark the step.

  python launch.py                                  # the default experiment (tiny)
  python launch.py --list
  python launch.py --experiment=cpu_char --mode=benchmark --devices=1
  python launch.py --set model.num_layers=4 --set mesh.tensor=4

Every result is appended to OUTPUT_DIR/results.jsonl. Bad input exits with code 2 and
one line on stderr.
"""

import os
import sys

import platform_env


# Projection compiles a reduced mesh (model-parallel axes at full size) on host CPU
# devices when it cannot compile for the GPU itself; this many cover GPT-3 175B's.
PROJECTION_HOST_DEVICES = 512


def _projects(argv: list[str]) -> bool:
  """Whether the run projects: --mode=project or search, or a sweep whose definition projects."""
  if "--mode=project" in argv or "--mode=search" in argv:
    return "--hardware=host" not in argv
  if "--mode=sweep" in argv:
    from sweep import definitions  # pylint: disable=import-outside-toplevel (imports no jax)
    names = [a.split("=", 1)[1] for a in argv if a.startswith("--experiment=")]
    definition = definitions.SWEEPS.get(names[-1] if names else "")
    return definition is not None and definition.mode == "project"
  return False


def _host_devices_from_argv(argv: list[str]) -> int:
  """The host platform is sized before jax starts, so --devices and --mode are read early
  (a malformed --devices is left for absl to reject)."""
  for arg in argv:
    if arg.startswith("--devices="):
      value = platform_env.whole_number(arg.split("=", 1)[1])
      if value is not None and value > platform_env.MAX_HOST_DEVICES and not platform_env.has_nvidia_gpu():
        platform_env.refuse(f"--devices: at most {platform_env.MAX_HOST_DEVICES:,} emulated "
                            f"CPU devices, got {value:,}")
      if value is not None and value > platform_env.DEFAULT_HOST_DEVICES:
        return value
  if _projects(argv):
    return PROJECTION_HOST_DEVICES
  return platform_env.DEFAULT_HOST_DEVICES


platform_env.configure(_host_devices_from_argv(sys.argv),
                       platform_env.distributed_from_argv(sys.argv))

# pylint: disable=wrong-import-position
import dataclasses
import datetime
import math
import time

import jax
import tqdm
from absl import app, flags

import experiments
from errors import RunStopped, UserInputError
from experiments import overrides
from hardware import catalog
from model.flops import param_count, train_flops_per_token
from parallelism import mesh as mesh_lib
from parallelism import one_f_one_b, pipeline
from projection import project
from projection import search
from report import results, table
from sweep import definitions as sweeps
from sweep import runner as sweep_runner
from sweep import summary as sweep_summary
from train import hooks as hooks_lib
from train import loop
from train import checkpoint as checkpoint_lib
from train import step as train_step
from train.checkpoint import Checkpoints

MODES = ("train", "benchmark", "project", "search", "sweep")

_EXPERIMENT = flags.DEFINE_string("experiment", "tiny", "Experiment name: a file in experiments/.")
_LIST = flags.DEFINE_bool("list", False, "List the experiments and exit.")
_MODE = flags.DEFINE_enum("mode", "train", MODES,
                          "train: run the experiment's task and record losses; "
                          "benchmark: time the step on synthetic tokens; "
                          "project: compile for --hardware and cost it on --gpus GPUs; "
                          "search: the best parallelism configurations for --hardware and "
                          "--gpus (projection/search.py); "
                          "sweep: the experiment's sweep (sweep/definitions.py).")
_STEPS = flags.DEFINE_integer("steps", None, "Timed steps (overrides train.steps).", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices", None, "Use the first N local devices (default: all).",
                                lower_bound=1)
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs", "Where results.jsonl is appended.")
_HARDWARE = flags.DEFINE_list("hardware", ["h100"], "project: hardware names "
                              "(a100, h100, h200, b200, gb200, gb300, host), comma-separated.")
_GPUS = flags.DEFINE_list("gpus", ["512"], "project: GPU counts, comma-separated.")
_TOP = flags.DEFINE_integer("top", 5, "search: how many configurations to print.", lower_bound=1)
_SEARCH_BUDGET = flags.DEFINE_integer("search_budget", search.DEFAULT_BUDGET,
                                      "search: candidates projected (compiled) at most, per "
                                      "hardware and GPU count.", lower_bound=1)
_PROFILE_STEPS = flags.DEFINE_string("profile_steps", None, "A:B: a JAX profiler trace of steps "
                                     "A..B-1 (from 0, warm-up included) in OUTPUT_DIR/profile.")
_CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", None, "Save checkpoints here and resume "
                                      "from the newest one (train and benchmark modes).")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 100, "Save every N steps.")
_KEEP_CHECKPOINTS = flags.DEFINE_integer("keep_checkpoints", 3, "Keep the newest N checkpoints.")
# Read before absl parses them (platform_env.distributed_from_argv): jax joins first.
flags.DEFINE_string("coordinator_address", None, "Multi-process: process 0's HOST:PORT.")
flags.DEFINE_integer("num_processes", None, "Multi-process: the number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-process: this process's id, 0 .. N-1.")
flags.DEFINE_integer("heartbeat_timeout_s", platform_env.DEFAULT_HEARTBEAT_TIMEOUT_S,
                     "Multi-process: a process silent this long is dead; the others abort.")
_SET = flags.DEFINE_multi_string("set", [], "KEY=VALUE override of a config field, repeatable "
                                 "(e.g. model.num_layers=4, mesh.tensor=2, model=gpt3-1.3b).")


def _experiment(mode: str, first: tuple[str, ...] = (),
                gpus: int | None = None) -> experiments.ExperimentConfig:
  """The experiment on `gpus` GPUs (the variant they select), then `first` and the user's
  --set overrides."""
  exp = experiments.load(_EXPERIMENT.value)
  if gpus is not None:
    exp = experiments.at_gpus(exp, gpus)
  exp = overrides.apply(exp, [*first, *_SET.value])
  if _STEPS.value:
    exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, steps=_STEPS.value))
  if mode == "benchmark":
    exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, task="synthetic"))
  exp.model.validate()
  exp.train.validate()
  return exp


def _devices(wanted: int | None) -> list:
  available = jax.devices()
  wanted = wanted or len(available)
  if wanted > len(available):
    raise UserInputError(f"--devices must be at most {len(available)} here, got {wanted}")
  return available[:wanted]


def _capacity_bytes(devices: list) -> int:
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"] * len(devices)
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # host devices share it


def _check_activation_memory(exp: experiments.ExperimentConfig, layout: mesh_lib.MeshLayout,
                             devices: list) -> None:
  """Refuse a batch or sequence whose activations cannot fit, before building the step
  (an absurd one would otherwise exhaust the host's memory while compiling or running).
  The bound is one layer's activations for the sequences in flight, a lower bound
  whatever the remat policy: s*b*h*(34 + 5*a*s/h) bytes at 16 bits (Korthikanti et al.
  2022, arXiv:2205.05198, section 4.1), scaled to the compute dtype."""
  m, t = exp.model, exp.train
  replicas = layout.sizes["data"] * layout.sizes["fsdp"]
  sequences = t.global_batch if not t.micro_batch else min(t.global_batch,
                                                           t.micro_batch * replicas)
  dtype_bytes = 4 if m.compute_dtype == "float32" else 2
  one_layer = (m.seq_len * sequences * m.d_model
               * (34 + 5 * m.num_heads * m.seq_len / m.d_model) * dtype_bytes / 2)
  capacity = _capacity_bytes(devices)
  if one_layer > 0.8 * capacity:
    raise UserInputError(
        f"train.global_batch x model.seq_len: {sequences:,} sequences of {m.seq_len:,} "
        f"tokens need at least {one_layer / 1e9:,.0f} GB of activations for one layer, "
        f"these {len(devices)} devices have {capacity / 1e9:,.0f} GB; use a smaller batch, "
        f"sequence or train.micro_batch")


def _check_memory(program: train_step.TrainProgram, model_name: str, devices: list) -> None:
  """Refuse a model whose parameters and optimizer state cannot fit, before allocating."""
  state_bytes = sum(math.prod(x.shape) * x.dtype.itemsize
                    for x in jax.tree.leaves(program.abstract_state))
  capacity = _capacity_bytes(devices)
  if state_bytes > 0.8 * capacity:
    raise UserInputError(
        f"model: {model_name} needs {state_bytes / 1e9:,.0f} GB for parameters and "
        f"optimizer state, these {len(devices)} devices have {capacity / 1e9:,.0f} GB; "
        f"choose a smaller size, e.g. --set model=gpt3-125m")


def _peak_tflops_per_device(devices: list, dtype: str) -> tuple[float, str]:
  if devices[0].platform == "cpu":
    host = loop.measure_matmul_tflops(dtype)
    return host / len(devices), (f"measured: {dtype} 2048^3 matmul on this host, "
                                 f"{host * 1e3:.0f} GFLOP/s shared by {len(devices)} CPU devices")
  kind = devices[0].device_kind.upper()  # e.g. "NVIDIA H100 80GB HBM3"
  # Longest name first: "GB200" must not match as "B200".
  for name in sorted(catalog.names(), key=len, reverse=True):
    if name.upper() in kind:
      hw = catalog.get(name)
      # MFU on GPUs is quoted against dense BF16 peak, whatever the compute dtype.
      return hw.peak_tflops("bf16"), f"{hw.name} dense BF16 peak, hardware/catalog.py"
  raise UserInputError(f"--devices: no peak figure for {devices[0].device_kind} in hardware/catalog.py")


def _step_hooks(exp: experiments.ExperimentConfig, mode: str, devices: int, peak_tflops: float,
                profile: tuple[int, int] | None) -> list[hooks_lib.StepHook]:
  """TensorBoard scalars in OUTPUT_DIR/tensorboard/<run>, and the --profile_steps trace."""
  run = (f"{exp.name}_{mode}_{devices}dev_"
         f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S-%f')}")
  hooks = [hooks_lib.TensorBoardHook(
      os.path.join(_OUTPUT_DIR.value, "tensorboard", run),
      exp.train.global_batch * exp.model.seq_len, train_flops_per_token(exp.model), devices,
      peak_tflops)]
  if profile:
    hooks.append(hooks_lib.ProfileHook(os.path.join(_OUTPUT_DIR.value, "profile"), *profile))
  return hooks


def _pipeline_record(exp: experiments.ExperimentConfig, stages: int, micro_batches: int) -> dict:
  """The pipeline schedule's shape, printed and recorded when there is one."""
  if stages == 1:
    return {}
  virtual, schedule = exp.train.virtual_stages, exp.train.pipeline_schedule
  passes = pipeline.passes(exp.train.pipeline_passes, micro_batches, stages, schedule)
  per_pass = micro_batches // passes
  record = {"pipeline_schedule": schedule, "virtual_stages": virtual,
            "micro_batches": micro_batches, "pipeline_passes": passes,
            "pipeline_trips": passes * pipeline.trips(per_pass, stages, virtual),
            "bubble_fraction": pipeline.bubble_fraction(per_pass, stages, virtual)}
  if schedule == "1f1b":
    plan = one_f_one_b.schedule(micro_batches, stages, virtual)
    trips = (f"{plan.delay} forward, {plan.groups - 1} x {plan.group_trips} both, "
             f"{plan.drain_trips} backward; residual slots {plan.slots} chunks")
  else:
    trips = f"{record['pipeline_trips']} = {passes} x {pipeline.trips(per_pass, stages, virtual)}"
  print(table.key_values("Pipeline", [
      ("schedule", f"{schedule}, {stages} stages x {virtual} virtual"),
      ("micro-batches", f"{micro_batches} per data-parallel replica, in {passes} pass(es)"),
      ("loop trips", f"{trips}, bubble {record['bubble_fraction']:.1%}")]))
  return record


def _run_measured(exp: experiments.ExperimentConfig, mode: str,
                  num_devices: int | None = None) -> dict | None:
  profile = None
  if _PROFILE_STEPS.value:
    profile = hooks_lib.parse_profile_steps(_PROFILE_STEPS.value,
                                            exp.train.warmup_steps + exp.train.steps)
  devices = _devices(num_devices)
  if exp.model.attention == "cudnn" and devices[0].platform != "gpu":
    raise UserInputError(f"model.attention=cudnn runs on NVIDIA GPUs only, these devices are "
                         f"{devices[0].platform.upper()}; use model.attention=xla (projections "
                         f"take cudnn: --mode=project)")
  layout = mesh_lib.plan(exp.mesh, len(devices))
  _check_activation_memory(exp, layout, devices)
  mesh = mesh_lib.build_mesh(layout, devices)
  program = train_step.build(exp.model, exp.train, mesh)
  _check_memory(program, exp.model.name, devices)
  print(table.key_values(
      f"Mesh: {layout.devices} {devices[0].platform.upper()} devices as {layout.nodes} nodes "
      f"x {layout.devices_per_node}", [(line, "") for line in layout.describe()]))
  pipeline_record = _pipeline_record(exp, layout.sizes["pipeline"], program.micro_batches)
  peak, peak_source = _peak_tflops_per_device(devices, exp.model.compute_dtype)
  checkpoints = None
  if _CHECKPOINT_DIR.value is not None:  # before the hooks: a refused one leaves no files
    checkpoints = Checkpoints(_CHECKPOINT_DIR.value, _CHECKPOINT_EVERY.value,
                              _KEEP_CHECKPOINTS.value)
  hooks = _step_hooks(exp, mode, layout.devices, peak, profile)
  run = loop.run(program, exp.model, exp.train, checkpoints, hooks)
  if not run.step_times_s:
    print(f"\nnothing left to run: the checkpoint in {_CHECKPOINT_DIR.value} is at step "
          f"{run.first_step}, the run has {exp.train.warmup_steps + exp.train.steps}")
    return None
  tokens_per_step = exp.train.global_batch * exp.model.seq_len
  record = {
      "mode": mode, "experiment": exp.name, "model": exp.model.name,
      "params": param_count(exp.model), "devices": layout.devices, "nodes": layout.nodes,
      "mesh": layout.sizes, "mesh_nvlink": layout.nvlink, "mesh_infiniband": layout.infiniband,
      "global_batch": exp.train.global_batch, "seq_len": exp.model.seq_len,
      "tokens_per_step": tokens_per_step, "timed_steps": exp.train.steps,
      "compute_dtype": exp.model.compute_dtype, "remat": exp.model.remat,
      "platform": devices[0].platform, "device_kind": devices[0].device_kind,
      **loop.summarize(run, tokens_per_step, layout.devices,
                       train_flops_per_token(exp.model), peak),
      "peak_source": peak_source,
      "tensorboard_dir": hooks[0].log_dir,
      "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      **pipeline_record,
  }
  if profile:
    record["profile_dir"] = hooks[-1].log_dir
  if mode == "train":
    record["losses"] = run.losses
  if run.first_step:
    record["resumed_from_step"] = run.first_step
  return record


def _print_record(record: dict) -> None:
  rows = [("experiment", f"{record['experiment']} ({record['model']}, "
                         f"{record['params']:,} parameters)"),
          ("batch", f"{record['global_batch']} x {record['seq_len']} tokens"),
          ("compile", f"{record['compile_s']:.2f} s (lowering {record['lower_s']:.2f} s)"),
          ("step time", f"{record['step_time_s'] * 1e3:,.1f} ms median, "
                        f"{record['step_time_p90_s'] * 1e3:,.1f} ms p90 "
                        f"over {record['timed_steps']} steps"),
          ("tokens/s", f"{record['tokens_per_s']:,.0f} ({record['tokens_per_s_per_device']:,.0f} "
                       f"per device)"),
          ("TFLOP/s per device", f"{record['model_tflops_per_device']:.4f} model FLOPs"),
          ("MFU", f"{record['mfu']:.1%} of {record['peak_tflops_per_device']:.4f} TFLOP/s peak "
                  f"({record['peak_source']})")]
  if "losses" in record:
    rows.append(("loss", f"{record['losses'][0]:.3f} -> {record['losses'][-1]:.3f}"))
  print()
  print(table.key_values(f"Result ({record['mode']})", rows))


def _projection_points(check_plan: bool = True) -> list[tuple[str, int]]:
  """Every (hardware, gpus) point, all checked before the first compile (with
  `check_plan`, the experiment's own layout on each)."""
  counts = []
  if not _GPUS.value or not _HARDWARE.value:
    raise UserInputError(f"--{'gpus' if not _GPUS.value else 'hardware'}: empty; give at least "
                         f"one, comma-separated")
  for text in _GPUS.value:
    count = platform_env.whole_number(text.strip())
    if count is None or count < 1:
      raise UserInputError(f"--gpus takes positive whole numbers, got {text!r}")
    counts.append(count)
  points = [(name.strip().lower(), gpus) for name in _HARDWARE.value for gpus in counts]
  for name, gpus in points:
    hw = project.hardware(name, gpus)
    if check_plan:
      project.plan(_experiment("project", gpus=gpus), hw, gpus)
  return points


def _append(record: dict) -> None:
  record["time"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  results.append(_OUTPUT_DIR.value, record)


def _run_projection() -> list[dict]:
  points = _projection_points()
  records = []
  progress = tqdm.tqdm(points, desc="projecting", unit="point", disable=len(points) < 2)
  for name, gpus in progress:
    progress.set_postfix_str(f"{name} x {gpus}")
    record = project.project(_experiment("project", gpus=gpus), name, gpus)
    _append(record)
    records.append(record)
  return records


def _print_projection(records: list[dict]) -> None:
  headers = ("hardware", "gpus", "nodes", "data x fsdp x tensor x pipeline", "step s", "tokens/s/GPU",
             "MFU", "memory GB", "compute s", "exposed comm s", "other s", "compiled for")
  rows = []
  for r in records:
    mesh = " x ".join(str(r["mesh"][a]) for a in mesh_lib.AXES)
    memory = f"{r['memory_per_gpu_gb']:.1f} / {r['hbm_capacity_gb']:.0f}"
    if r["fits"]:
      b = r["breakdown"]
      timing = (r["step_time_s"], f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['mfu']:.1%}", memory,
                b["compute_s"], b["exposed_comm_s"], b["other_s"])
    else:
      timing = (f"does not fit: {r['over_capacity_gb']:.1f} GB over", "", "", memory, "", "", "")
    rows.append((r["hardware"], r["gpus"], r["nodes"], mesh, *timing, r["compile_target"]))
  if any("time_to_train_min" in r for r in records):
    headers += ("bubble s", "time to train min")
    rows = [(*row, r.get("breakdown", {}).get("bubble_s", ""), r.get("time_to_train_min", ""))
            for row, r in zip(rows, records)]
  first = records[0]
  print(f"\n{first['experiment']}: {first['model']}, global batch {first['global_batch']} x "
        f"{first['seq_len']} tokens, {first['compute_dtype']}, remat {first['remat']}")
  print(table.columns(headers, rows))
  for note in sorted({r["compile_note"] for r in records if r["compile_note"]}):
    print(f"note: compiled on host CPU devices: {note}")


def _run_search() -> None:
  """Search each (hardware, gpus) point: every valid configuration ranked by the prior,
  the first --search_budget projected and appended, the best --top printed."""
  points = _projection_points(check_plan=False)
  for name, gpus in points:
    search.check_point(name, gpus)
  searches = []
  for name, gpus in points:
    exp = _experiment("project", gpus=gpus)
    start = time.perf_counter()
    bars: list[tqdm.tqdm] = []  # made at the first projection: bad input prints nothing else

    def step(done: int, to_do: int, candidate: search.Candidate, bars=bars, name=name,
             gpus=gpus) -> None:
      if not bars:
        bars.append(tqdm.tqdm(total=to_do, desc=f"searching {name} x {gpus}", unit="point"))
      bars[0].update(done - bars[0].n)
      bars[0].set_postfix_str(" ".join(candidate.assignments()[:3]))

    try:
      found = search.search(exp, name, gpus, _SEARCH_BUDGET.value, progress=step,
                            on_record=_append)
      for bar in bars:
        bar.update(bar.total - bar.n)
    finally:
      for bar in bars:
        bar.close()
    searches.append((exp, found, time.perf_counter() - start))
  for exp, found, wall_s in searches:
    _print_search(exp, found, wall_s)


def _print_search(exp: experiments.ExperimentConfig, found: search.Result, wall_s: float) -> None:
  ranking = found.ranking
  pruned = sum(ranking.pruned.values())
  print(f"\n{exp.name}: {exp.model.name} on {found.gpus} {found.hardware}, global batch "
        f"{exp.train.global_batch} x {exp.model.seq_len} tokens; searched in {wall_s:.0f} s")
  print(f"{ranking.candidates:,} configurations, {pruned:,} pruned, "
        f"{len(ranking.survivors):,} valid; {len(found.records)} projected in prior order "
        f"({found.compiles} new compiles)")
  for reason, count in ranking.pruned.items():
    print(f"  pruned {count:>6,}: {reason} (e.g. {ranking.examples[reason]})")
  best = found.best(_TOP.value)
  fitting = best and best[0]["fits"]
  if not fitting:
    print(f"none of the {len(found.records)} projected fits; the least over capacity:")
  headers = ["TP", "PP", "VS", "micro-batch", "schedule", "remat", "data", "step s", "GB/GPU",
             "MFU", "prior rank"]
  has_ttt = any("time_to_train_min" in r for r in best)
  if has_ttt:
    headers.insert(-1, "time to train min")
  rows = []
  for r in best:
    s = r["search"]
    memory = f"{r['memory_per_gpu_gb']:.1f} / {r['hbm_capacity_gb']:.0f}"
    step = r["step_time_s"] if r["fits"] else f"does not fit: {r['over_capacity_gb']:.1f} GB over"
    mfu = f"{r['mfu']:.1%}" if r["fits"] else ""
    row = [s["tensor_parallel"], s["pipeline_parallel"], s["virtual_stages"], s["micro_batch"],
           s["schedule"], s["remat"], r["mesh"]["data"], step, memory, mfu,
           s["prior_rank"]]
    if has_ttt:
      row.insert(-1, r.get("time_to_train_min", ""))
    rows.append(row)
  print(table.columns(headers, rows))
  print(f"best: --set {' --set '.join(best[0]['search']['set'])}")


def _run_sweep() -> None:
  definition = sweeps.get(_EXPERIMENT.value)
  exp = _experiment(definition.mode, definition.overrides)
  records = sweep_runner.run(exp, definition, _OUTPUT_DIR.value,
                             lambda e, n: _run_measured(e, "benchmark", n),
                             jax.devices()[0].platform,
                             lambda n: _experiment(definition.mode, definition.overrides, n))
  sweep_summary.finish(records, _OUTPUT_DIR.value)
  failed = [r["sweep_key"] for r in records if r["status"] == "failed"]
  if failed:  # a bug, not bad input: the reasons are in results.jsonl
    print(f"error: {len(failed)} points failed (run again to retry them): {', '.join(failed)}",
          file=sys.stderr)
    sys.exit(1)


def _check_distributed_flags() -> None:
  names = ("coordinator_address", "num_processes", "process_id")
  given = [n for n in names if flags.FLAGS[n].present]
  if given and len(given) < len(names):
    raise UserInputError(f"--{', --'.join(names)} go together; got only --{', --'.join(given)}")


def _check_paths() -> None:
  """Where results, TensorBoard scalars and checkpoints go must be usable before any
  compile: a run must not train to the end and then lose its record."""
  results.check_writable(_OUTPUT_DIR.value)
  if _CHECKPOINT_DIR.value is not None and _MODE.value in ("train", "benchmark"):
    checkpoint_lib.check_directory(_CHECKPOINT_DIR.value)
  if _CHECKPOINT_EVERY.value < 1:
    raise UserInputError(f"--checkpoint_every must be a positive integer, got "
                         f"{_CHECKPOINT_EVERY.value}")
  if _KEEP_CHECKPOINTS.value < 1:
    raise UserInputError(f"--keep_checkpoints must be a positive integer, got "
                         f"{_KEEP_CHECKPOINTS.value}")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise UserInputError(f"unexpected argument {argv[1]!r}; flags take the form --name=value")
  if _LIST.value:
    for name in experiments.names():
      print(f"{name:<16} {experiments.load(name).description}")
    return
  _check_distributed_flags()
  _check_paths()
  if _MODE.value == "sweep":
    _run_sweep()
    return
  if _MODE.value == "search":
    _run_search()
    print(f"\nappended to {os.path.join(_OUTPUT_DIR.value, 'results.jsonl')}")
    return
  if _MODE.value == "project":
    _print_projection(_run_projection())
    print(f"\nappended to {os.path.join(_OUTPUT_DIR.value, 'results.jsonl')}")
    return
  record = _run_measured(_experiment(_MODE.value), _MODE.value, _DEVICES.value)
  if record is None or jax.process_index() != 0:
    return
  path = results.append(_OUTPUT_DIR.value, record)
  _print_record(record)
  print(f"\nappended to {path}")


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def _main(argv: list[str]) -> None:
  try:
    main(argv)
  except UserInputError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except RunStopped as e:
    print(f"stopped: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
  except KeyboardInterrupt:
    # Outside the loop's own handling (start-up, a projection): nothing half-written is
    # kept by a save then. os._exit: XLA's threads may still be running.
    sys.stdout.flush()
    print("stopped: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    os._exit(130)  # pylint: disable=protected-access


if __name__ == "__main__":
  app.run(_main, flags_parser=_parse_flags)
