"""CPU training throughput: JAX against its float32 matmul peak and a PyTorch reference.

For each experiment (cpu_char and cpu_gpt2_small by default), on one CPU device in
float32, one run measures in interleaved rounds: the 2048^3 float32 matmul rate JAX
reaches (the peak, train/loop.py), JAX's train step on synthetic tokens, and the same
model's nanoGPT-style PyTorch eager step (benchmarks/torch_gpt.py, run by a worker
process of --torch_python) when that interpreter can import torch; otherwise one line
says the reference is skipped.

  python benchmarks/cpu_perf.py
  python benchmarks/cpu_perf.py --torch_python=/path/to/venv/bin/python --rounds=5
  python benchmarks/cpu_perf.py --experiments=cpu_char --steps=2

On a machine shared with other jobs the load drifts, so every round runs both frameworks
back to back and the speed ratio is taken per round (median and range reported); the
peak is sampled around every round and the highest sample is used, so load lowers the
share of peak rather than raising it. The load average is printed for the same reason.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import platform_env

platform_env.configure(host_devices=1)

# pylint: disable=wrong-import-position
import jax
import numpy as np

import experiments
from measure import rates
from measure.point import build_point
from model.config import ModelConfig
from model.flops import param_count, train_flops_per_token
from parallelism import mesh as mesh_lib
from report import table
from train import data, loop
from train.config import TrainConfig

EXPERIMENTS = ("cpu_char", "cpu_gpt2_small")
# A PyTorch reference below this share of the in-run matmul peak is not a sane reference,
# and no speed ratio is reported against it. nanoGPT's model spends most of its FLOPs in
# float32 GEMMs that run near that peak: on this project's 2-core machines it trains
# cpu_gpt2_small at 205-230 tokens/s, 58-65% of the peak, while the slowed references
# that once made a 1.1x claim look met ran at about 35%.
REFERENCE_MIN_OF_PEAK = 0.5
# CPU flags that decide XLA:CPU's and oneDNN's fast float32 paths.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
# Timed steps per framework per round: a round takes about 20-30 s on a quiet 2-core host.
DEFAULT_STEPS = {"cpu_char": 3, "cpu_gpt2_small": 2}
TORCH_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_gpt.py")


class JaxStep:
  """The compiled float32 train step of one experiment on one device, steppable."""

  def __init__(self, model: ModelConfig, train: TrainConfig, mesh_cfg: mesh_lib.MeshConfig):
    self.model, self.train = model, train
    # launch.py's plan -> build_mesh -> build (run_point's first half); the steps are run
    # here, one at a time, to interleave them with PyTorch's.
    exp = experiments.ExperimentConfig(
      name=model.name, description="cpu_perf", model=model, mesh=mesh_cfg, train=train
    )
    _, self.program = build_point(exp, jax.devices()[:1])
    start = time.perf_counter()
    self.compiled = self.program.lower(train.global_batch, model.seq_len).compile()
    self.compile_s = time.perf_counter() - start
    self.state = self.program.init()
    self.step_index = 0
    # Not timed: the first runs of the compiled step grow the heap to its steady size
    # (cpu_gpt2_small page-faults about 300,000 times in each of its first three steps,
    # none after; PyTorch's worker warms up too).
    self.run(3)

  def run(self, steps: int) -> list[float]:
    B, T = self.train.global_batch, self.model.seq_len
    times = []
    for _ in range(steps):
      batch = data.batch("synthetic", self.train.seed, self.step_index, B, T, self.model.vocab_size)
      batch = jax.block_until_ready(jax.device_put(batch, self.program.batch_sharding))
      start = time.perf_counter()
      self.state, metrics = self.compiled(self.state, batch)
      jax.block_until_ready((self.state, metrics))
      times.append(time.perf_counter() - start)
      self.step_index += 1
    return times


class TorchStep:
  """benchmarks/torch_gpt.py in a worker process: the same model's PyTorch eager step."""

  def __init__(self, python: str, model: ModelConfig, train: TrainConfig):
    args = {
      "num_layers": model.num_layers,
      "d_model": model.d_model,
      "num_heads": model.num_heads,
      "seq_len": model.seq_len,
      "vocab": model.padded_vocab,
      "batch": train.global_batch,
      "learning_rate": train.learning_rate,
    }
    self._proc = subprocess.Popen(
      [python, TORCH_WORKER] + [f"--{k}={v}" for k, v in args.items()],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
    )
    self.info = self._reply()

  def _reply(self) -> dict:
    line = self._proc.stdout.readline()
    if not line:
      raise RuntimeError(f"PyTorch worker exited with {self._proc.wait()} (its errors are above)")
    return json.loads(line)

  def run(self, steps: int) -> list[float]:
    self._proc.stdin.write(f"{steps}\n")
    self._proc.stdin.flush()
    return self._reply()["step_times_s"]

  def close(self) -> None:
    self._proc.stdin.close()
    self._proc.wait()


def machine() -> str:
  """One line: the CPU model, the flags of CPU_FLAGS it has, cores and library versions."""
  model, flags = "unknown CPU", set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
          model = value.strip()
        elif key.strip() == "flags":
          flags = set(value.split())
  except OSError:
    pass
  present = [flag for flag in CPU_FLAGS if flag in flags] or ["none of " + " ".join(CPU_FLAGS)]
  return (
    f"{model}; {os.cpu_count()} cores; flags {' '.join(present)}; jax {jax.__version__}, "
    f"jaxlib {jax.lib.__version__}, numpy {np.__version__}, Python {sys.version.split()[0]}"
  )


def torch_importable(python: str) -> bool:
  return (
    subprocess.run([python, "-c", "import torch"], check=False, capture_output=True).returncode == 0
  )


def measure(name: str, steps: int | None, rounds: int, torch_python: str | None) -> dict:
  exp = experiments.load(name)
  model = dataclasses.replace(exp.model, param_dtype="float32", compute_dtype="float32")
  train = dataclasses.replace(exp.train, task="synthetic")
  steps = steps or DEFAULT_STEPS.get(name, 2)
  load_start = os.getloadavg()[0]
  jax_step = JaxStep(model, train, exp.mesh)
  torch_step = TorchStep(torch_python, model, train) if torch_python else None
  peaks = [rates.measure_matmul_tflops("float32")]
  jax_rounds, torch_rounds = [], []
  for _ in range(rounds):
    jax_rounds.append(jax_step.run(steps))
    if torch_step:
      torch_rounds.append(torch_step.run(steps))
    peaks.append(rates.measure_matmul_tflops("float32"))
  if torch_step:
    torch_step.close()

  tokens_per_step = train.global_batch * model.seq_len
  flops_per_token = train_flops_per_token(model)
  jax_times = [t for r in jax_rounds for t in r]
  result = loop.RunResult(0.0, jax_step.compile_s, jax_times, [], None)
  summary = rates.summarize(result, tokens_per_step, 1, flops_per_token, max(peaks))
  out = {
    "experiment": name,
    "params": param_count(model),
    "tokens_per_step": tokens_per_step,
    "steps": steps,
    "rounds": rounds,
    "peak_samples": peaks,
    "load": (load_start, os.getloadavg()[0]),
    **summary,
  }
  if torch_step:
    torch_s = float(np.median([t for r in torch_rounds for t in r]))
    # JAX's speed over PyTorch's, per round: both saw about the same load.
    ratios = [np.median(t) / np.median(j) for j, t in zip(jax_rounds, torch_rounds)]
    torch_of_peak = tokens_per_step * flops_per_token / torch_s / 1e12 / max(peaks)
    out.update(
      torch_of_peak=torch_of_peak,
      reference_sane=torch_of_peak >= REFERENCE_MIN_OF_PEAK,
      torch_version=torch_step.info["torch"],
      torch_threads=torch_step.info["threads"],
      torch_tokens_per_s=tokens_per_step / torch_s,
      torch_tflops=tokens_per_step * flops_per_token / torch_s / 1e12,
      speed_ratio=float(np.median(ratios)),
      speed_ratios=[float(r) for r in ratios],
    )
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--experiments",
    default=",".join(EXPERIMENTS),
    help="comma-separated experiment names (default: %(default)s)",
  )
  parser.add_argument(
    "--steps",
    type=int,
    default=None,
    help="timed steps per framework per round (default: 3 for cpu_char, 2 for cpu_gpt2_small)",
  )
  parser.add_argument(
    "--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)"
  )
  parser.add_argument(
    "--torch_python",
    default=sys.executable,
    help="interpreter that runs the PyTorch reference (default: this one)",
  )
  args = parser.parse_args()
  for flag in ("steps", "rounds"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      parser.error(f"--{flag} must be at least 1")
  names = [n for n in args.experiments.split(",") if n]
  unknown = sorted(set(names) - set(experiments.names()))
  if unknown:
    parser.error(
      f"unknown experiment {', '.join(unknown)}; choose from {', '.join(experiments.names())}"
    )
  torch_python = args.torch_python if torch_importable(args.torch_python) else None
  if torch_python is None:
    print(
      f"PyTorch reference skipped: torch is not importable by {args.torch_python} "
      f"(see --torch_python)"
    )

  print(f"machine: {machine()}; load {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
  rows = []
  for name in names:
    r = measure(name, args.steps, args.rounds, torch_python)
    print(
      f"{name}: {r['rounds']} rounds of {r['steps']} timed steps; matmul peak samples "
      f"{', '.join(f'{p * 1e3:.0f}' for p in r['peak_samples'])} GFLOP/s",
      flush=True,
    )
    torch_cells = ["-", "-"]
    if "speed_ratio" in r:
      ratios = r["speed_ratios"]
      ratio = f"{r['speed_ratio']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
      if not r["reference_sane"]:
        ratio = "withheld"
        print(
          f"{name}: no JAX/PyTorch ratio: the PyTorch reference reached "
          f"{r['torch_of_peak']:.0%} of the matmul peak, below the "
          f"{REFERENCE_MIN_OF_PEAK:.0%} a sane reference reaches (REFERENCE_MIN_OF_PEAK); "
          "check its threads and the machine's load"
        )
      torch_cells = [f"{r['torch_tokens_per_s']:,.0f} ({r['torch_of_peak']:.0%} of peak)", ratio]
      print(
        f"{name}: PyTorch {r['torch_version']} on {r['torch_threads']} threads, "
        f"{r['torch_tflops'] * 1e3:.1f} model GFLOP/s; per-round JAX/PyTorch speed "
        f"{', '.join(f'{x:.2f}' for x in ratios)}"
      )
    rows.append(
      [
        r["experiment"],
        f"{r['params'] / 1e6:.1f}M",
        r["tokens_per_step"],
        f"{r['step_time_s']:.2f}",
        f"{r['tokens_per_s']:,.0f}",
        f"{r['model_tflops_per_device'] * 1e3:.1f}",
        f"{r['peak_tflops_per_device'] * 1e3:.1f}",
        f"{r['mfu']:.1%}",
        *torch_cells,
        f"{r['compile_s']:.1f}",
        f"{r['load'][0]:.1f}-{r['load'][1]:.1f}",
      ]
    )
  print()
  print(
    f"One {jax.devices()[0].device_kind} device ({os.cpu_count()} cores), float32, "
    f"synthetic tokens; model FLOPs from model/flops.py"
  )
  print(
    table.columns(
      [
        "experiment",
        "params",
        "tokens/step",
        "JAX step s",
        "JAX tokens/s",
        "model GFLOP/s",
        "peak GFLOP/s",
        "of peak",
        "PyTorch tokens/s",
        "JAX/PyTorch",
        "compile s",
        "load",
      ],
      rows,
    )
  )
  print(
    "\npeak: best float32 2048^3 JAX matmul sampled around every round; JAX/PyTorch: "
    "median (range) of per-round speed ratios; load: 1-minute load average at the start "
    "and the end (above the core count, other jobs share the CPUs)."
  )


if __name__ == "__main__":
  main()
