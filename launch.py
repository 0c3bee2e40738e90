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


def _host_devices_from_argv(argv: list[str]) -> int:
  """--devices must size the host platform before jax starts, so read it early."""
  for arg in argv:
    if arg.startswith("--devices="):
      value = arg.split("=", 1)[1]
      if value.isdigit() and int(value) > platform_env.DEFAULT_HOST_DEVICES:
        return int(value)
  return platform_env.DEFAULT_HOST_DEVICES


platform_env.configure(_host_devices_from_argv(sys.argv))

# pylint: disable=wrong-import-position
import dataclasses
import datetime
import math

import jax
from absl import app, flags

import experiments
from errors import UserInputError
from experiments import overrides
from model.flops import param_count, train_flops_per_token
from parallelism import mesh as mesh_lib
from report import results, table
from train import loop
from train import step as train_step

MODES = ("train", "benchmark")

_EXPERIMENT = flags.DEFINE_string("experiment", "tiny", "Experiment name: a file in experiments/.")
_LIST = flags.DEFINE_bool("list", False, "List the experiments and exit.")
_MODE = flags.DEFINE_enum("mode", "train", MODES,
                          "train: run the experiment's task and record losses; "
                          "benchmark: time the step on synthetic tokens.")
_STEPS = flags.DEFINE_integer("steps", None, "Timed steps (overrides train.steps).", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices", None, "Use the first N local devices (default: all).",
                                lower_bound=1)
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs", "Where results.jsonl is appended.")
_SET = flags.DEFINE_multi_string("set", [], "KEY=VALUE override of a config field, repeatable "
                                 "(e.g. model.num_layers=4, mesh.tensor=2, model=gpt3-1.3b).")


def _experiment() -> experiments.ExperimentConfig:
  exp = overrides.apply(experiments.load(_EXPERIMENT.value), _SET.value)
  if _STEPS.value:
    exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, steps=_STEPS.value))
  if _MODE.value == "benchmark":
    exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, task="synthetic"))
  exp.model.validate()
  exp.train.validate()
  return exp


def _devices() -> list:
  available = jax.devices()
  wanted = _DEVICES.value or len(available)
  if wanted > len(available):
    raise UserInputError(f"--devices must be at most {len(available)} here, got {wanted}")
  return available[:wanted]


def _check_memory(program: train_step.TrainProgram, devices: list) -> None:
  """Refuse a model whose parameters and optimizer state cannot fit, before allocating."""
  state_bytes = sum(math.prod(x.shape) * x.dtype.itemsize
                    for x in jax.tree.leaves(program.abstract_state))
  stats = devices[0].memory_stats() or {}
  if "bytes_limit" in stats:
    capacity = stats["bytes_limit"] * len(devices)
  else:  # host devices share the machine's memory
    capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  if state_bytes > 0.8 * capacity:
    raise UserInputError(
        f"model: {program_name(program)} needs {state_bytes / 1e9:,.0f} GB for parameters and "
        f"optimizer state, these {len(devices)} devices have {capacity / 1e9:,.0f} GB; "
        f"choose a smaller size, e.g. --set model=gpt3-125m")


def program_name(program: train_step.TrainProgram) -> str:
  return f"{sum(math.prod(x.shape) for x in jax.tree.leaves(program.abstract_state.params)):,}-parameter model"


def _peak_tflops_per_device(devices: list, dtype: str) -> tuple[float, str]:
  if devices[0].platform == "cpu":
    host = loop.measure_matmul_tflops(dtype)
    return host / len(devices), (f"measured: {dtype} 2048^3 matmul on this host, "
                                 f"{host * 1e3:.0f} GFLOP/s shared by {len(devices)} CPU devices")
  raise UserInputError(f"--devices: no peak figure for {devices[0].device_kind}")


def _run_measured(exp: experiments.ExperimentConfig) -> dict:
  devices = _devices()
  layout = mesh_lib.plan(exp.mesh, len(devices))
  mesh = mesh_lib.build_mesh(layout, devices)
  print(table.key_values(
      f"Mesh: {layout.devices} {devices[0].platform.upper()} devices as {layout.nodes} nodes "
      f"x {layout.devices_per_node}", [(line, "") for line in layout.describe()]))
  program = train_step.build(exp.model, exp.train, mesh)
  _check_memory(program, devices)
  peak, peak_source = _peak_tflops_per_device(devices, exp.model.compute_dtype)
  run = loop.run(program, exp.model, exp.train)
  tokens_per_step = exp.train.global_batch * exp.model.seq_len
  record = {
      "mode": _MODE.value, "experiment": exp.name, "model": exp.model.name,
      "params": param_count(exp.model), "devices": layout.devices, "nodes": layout.nodes,
      "mesh": layout.sizes, "mesh_nvlink": layout.nvlink, "mesh_infiniband": layout.infiniband,
      "global_batch": exp.train.global_batch, "seq_len": exp.model.seq_len,
      "tokens_per_step": tokens_per_step, "timed_steps": exp.train.steps,
      "compute_dtype": exp.model.compute_dtype, "remat": exp.model.remat,
      "platform": devices[0].platform, "device_kind": devices[0].device_kind,
      **loop.summarize(run, tokens_per_step, layout.devices,
                       train_flops_per_token(exp.model), peak),
      "peak_source": peak_source,
      "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  if _MODE.value == "train":
    record["losses"] = run.losses
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


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise UserInputError(f"unexpected argument {argv[1]!r}; flags take the form --name=value")
  if _LIST.value:
    for name in experiments.names():
      print(f"{name:<16} {experiments.load(name).description}")
    return
  exp = _experiment()
  record = _run_measured(exp)
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


if __name__ == "__main__":
  app.run(_main, flags_parser=_parse_flags)
