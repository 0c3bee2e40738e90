"""CPU training throughput against the float32 matmul peak JAX reaches on this host.

For each experiment (cpu_char and cpu_gpt2_small by default), on one CPU device in
float32, one run measures: the 2048^3 float32 matmul rate (the peak, train/loop.py),
the train step's tokens/s on synthetic tokens, its model FLOP/s (model/flops.py) and
their fraction of the peak.

  python benchmarks/cpu_perf.py
  python benchmarks/cpu_perf.py --experiments=cpu_char --steps=10

The peak is sampled before and after each experiment and the highest sample is used,
so a machine shared with other jobs lowers the fraction rather than raising it; the
host's load average is printed for the same reason.
"""

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import platform_env  # noqa: E402

platform_env.configure(host_devices=1)

# pylint: disable=wrong-import-position
import jax  # noqa: E402

import experiments  # noqa: E402
from model.flops import param_count, train_flops_per_token  # noqa: E402
from parallelism import mesh as mesh_lib  # noqa: E402
from report import table  # noqa: E402
from train import loop  # noqa: E402
from train import step as train_step  # noqa: E402

EXPERIMENTS = ("cpu_char", "cpu_gpt2_small")
# Timed steps per experiment: about a minute each on a 2-core host.
DEFAULT_STEPS = {"cpu_char": 5, "cpu_gpt2_small": 3}


def _peak_tflops() -> float:
  return loop.measure_matmul_tflops("float32")


def measure(name: str, steps: int | None) -> dict:
  exp = experiments.load(name)
  model = dataclasses.replace(exp.model, param_dtype="float32", compute_dtype="float32")
  # One warm-up step: the first run of the compiled step allocates its buffers.
  train = dataclasses.replace(exp.train, task="synthetic", warmup_steps=1,
                              steps=steps or DEFAULT_STEPS.get(name, exp.train.steps))
  devices = jax.devices()[:1]
  mesh = mesh_lib.build_mesh(mesh_lib.plan(exp.mesh, 1), devices)
  program = train_step.build(model, train, mesh)
  peaks = [_peak_tflops()]
  result = loop.run(program, model, train)
  peaks.append(_peak_tflops())
  tokens_per_step = train.global_batch * model.seq_len
  summary = loop.summarize(result, tokens_per_step, 1, train_flops_per_token(model), max(peaks))
  return {"experiment": name, "params": param_count(model), "tokens_per_step": tokens_per_step,
          "steps": train.steps, "peak_samples": peaks, "load": os.getloadavg()[0], **summary}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--experiments", default=",".join(EXPERIMENTS),
                      help="comma-separated experiment names (default: %(default)s)")
  parser.add_argument("--steps", type=int, default=None,
                      help="timed steps per experiment (default: 5 for cpu_char, 3 for "
                           "cpu_gpt2_small)")
  args = parser.parse_args()
  if args.steps is not None and args.steps < 1:
    parser.error("--steps must be at least 1")
  names = [n for n in args.experiments.split(",") if n]
  unknown = sorted(set(names) - set(experiments.names()))
  if unknown:
    parser.error(f"unknown experiment {', '.join(unknown)}; choose from {', '.join(experiments.names())}")

  rows = []
  for name in names:
    r = measure(name, args.steps)
    rows.append([r["experiment"], f"{r['params'] / 1e6:.1f}M", r["tokens_per_step"],
                 f"{r['step_time_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
                 f"{r['model_tflops_per_device'] * 1e3:.1f}",
                 f"{r['peak_tflops_per_device'] * 1e3:.1f}", f"{r['mfu']:.1%}",
                 f"{r['compile_s']:.1f}", f"{r['load']:.1f}"])
    print(f"{name}: {r['steps']} timed steps; matmul peak samples "
          f"{', '.join(f'{p * 1e3:.0f}' for p in r['peak_samples'])} GFLOP/s", flush=True)
  print()
  print(f"One {jax.devices()[0].device_kind} device ({os.cpu_count()} cores), float32, "
        f"synthetic tokens; model FLOPs from model/flops.py")
  print(table.columns(["experiment", "params", "tokens/step", "step s", "tokens/s",
                       "model GFLOP/s", "peak GFLOP/s", "of peak", "compile s", "load"], rows))
  print("\npeak: best float32 2048^3 matmul sampled around the run; load: 1-minute load "
        "average at the end (above the core count, other jobs share the CPUs).")


if __name__ == "__main__":
  main()
