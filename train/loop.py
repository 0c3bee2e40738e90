"""Run the compiled train step and time it.

Lowering and compilation are timed apart from running; the first `warmup_steps`
executions are run but not timed; every timed step ends in `block_until_ready`, and
its batch is generated and placed on the devices before the clock starts.
"""

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from model.config import ModelConfig
from train import data
from train.config import TrainConfig
from train.hooks import StepHook
from train.step import TrainProgram


@dataclasses.dataclass(frozen=True)
class RunResult:
  lower_s: float
  compile_s: float
  step_times_s: list[float]     # timed steps only
  losses: list[float]           # every step, warm-up included
  final_state: object


def run(program: TrainProgram, model_cfg: ModelConfig, train_cfg: TrainConfig,
        hooks: Sequence[StepHook] = ()) -> RunResult:
  B, T = train_cfg.global_batch, model_cfg.seq_len
  t0 = time.perf_counter()
  lowered = program.lower(B, T)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()

  state = program.init()
  step_times, losses = [], []
  for step in range(train_cfg.warmup_steps + train_cfg.steps):
    batch = data.batch(train_cfg.task, train_cfg.seed, step, B, T, model_cfg.vocab_size)
    batch = jax.block_until_ready(jax.device_put(batch, program.batch_sharding))
    for hook in hooks:
      hook.before_step(step)
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    elapsed = time.perf_counter() - start
    if step >= train_cfg.warmup_steps:
      step_times.append(elapsed)
    losses.append(float(metrics["loss"]))
    for hook in hooks:
      hook.after_step(step, metrics, elapsed)
  for hook in hooks:
    hook.close()
  return RunResult(t1 - t0, t2 - t1, step_times, losses, state)


def measure_matmul_tflops(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
  """Best-of-`repeats` FLOP/s of one n x n x n matmul on the default device, in TFLOP/s."""
  a = jax.device_put(np.random.default_rng(0).standard_normal((n, n)).astype(dtype))
  matmul = jax.jit(lambda x: x @ x)
  jax.block_until_ready(matmul(a))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a))
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best / 1e12


def summarize(result: RunResult, tokens_per_step: int, devices: int,
              flops_per_token: float, peak_tflops_per_device: float) -> dict:
  """Step-time statistics and throughput; MFU is model FLOP/s over peak."""
  times = np.asarray(result.step_times_s)
  median = float(np.median(times))
  tokens_per_s = tokens_per_step / median
  model_tflops_per_device = tokens_per_s * flops_per_token / devices / 1e12
  return {
      "compile_s": round(result.lower_s + result.compile_s, 3),
      "lower_s": round(result.lower_s, 3),
      "step_time_s": median,
      "step_time_p90_s": float(np.percentile(times, 90)),
      "tokens_per_s": tokens_per_s,
      "tokens_per_s_per_device": tokens_per_s / devices,
      "model_tflops_per_device": model_tflops_per_device,
      "peak_tflops_per_device": peak_tflops_per_device,
      "mfu": model_tflops_per_device / peak_tflops_per_device,
  }
