"""Rates measured on this machine's devices: a matmul's FLOP/s (the MFU denominator on
CPU devices, measure/fit.py), and a timed run's step statistics, throughput and MFU."""

import time

import jax
import numpy as np

from train.loop import RunResult


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


def summarize(
  result: RunResult,
  tokens_per_step: int,
  devices: int,
  flops_per_token: float,
  peak_tflops_per_device: float,
) -> dict:
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
