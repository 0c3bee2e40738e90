"""Kernels the cost model takes at one rate, timed on this machine's GPU beside the cost
model's time for the very program that ran: for a lent GPU, what benchmarks/gpu_check.py
found the cost model lacks (docs/gpu_check.md).

Each case is a small jitted program, forward and backward where a train step runs both:
  attention  cuDNN flash attention, causal, 16 heads, 16,384 tokens a call, over sequence
             lengths (2,048 to 8,192) and head widths (128; 192 as latent attention's keys,
             its values padded to them, model/attention.py)
  gemm       a linear layer (x @ w and its two gradients) at the calibrations' shapes, bf16,
             and FP8 through model/fp8.py (its casts and amax reductions included)
  experts    the experts' batched GEMMs of model/moe.py, [E, C, D] x [E, D, F], over the
             tokens an expert gets (C: 128 to 4,096), DeepSeek-V3's D and F
  reduce     the reductions FP8's current scaling (amax over a tensor) and the norms (a sum
             over each row) run, over a [16,384, 12,288] bf16 activation
For each: the measured median (--iters after a warm-up), the projection of the program's
optimized HLO on --hardware (by default the catalog entry the GPU's name names;
projection/op_costs.py, per-kernel launches left out), their error, and the rate the
kernels reached (the program's dot FLOPs or HBM bytes, as projection/hlo.py counts them,
over the measured time).

  python benchmarks/kernel_check.py --output_dir=kernel_check     # one GPU, ~2 minutes
  python benchmarks/kernel_check.py --dry_run --output_dir=/tmp/kc  # host CPU, tiny sizes

OUTPUT_DIR receives kernel_check.jsonl (one record per case, appended) and
kernel_check.md (this run's table). Bad flags: one line on stderr, exit code 2.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import platform_env  # noqa: E402

if __name__ == "__main__":
  if "--dry_run" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"
  platform_env.configure(1)

# pylint: disable=wrong-import-position
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.gpu_check import Parser, catalog_entry_for  # noqa: E402
from benchmarks.gpu_check_report import ms, ratio  # noqa: E402
from hardware import catalog  # noqa: E402
from model import fp8  # noqa: E402
from projection import hlo  # noqa: E402
from projection.op_costs import projected_ops  # noqa: E402

JSONL, MARKDOWN = "kernel_check.jsonl", "kernel_check.md"


@dataclasses.dataclass(frozen=True)
class Case:
  family: str
  shape: str  # what the case's sizes are, as the table prints them
  build: Callable[[], tuple[Callable, tuple]]  # -> (function to jit, its operands)
  rate: str  # "TFLOP/s" (dot FLOPs) or "GB/s" (HBM bytes)


def _normal(shape: tuple[int, ...], dtype=jnp.bfloat16, seed: int = 0) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _attention(tokens: int, seq: int, heads: int, head_dim: int, cudnn: bool) -> Case:
  shape = (tokens // seq, seq, heads, head_dim)  # [B, T, H, D]
  impl = "cudnn" if cudnn else None

  def build():
    q, k, v = (_normal(shape, seed=i) for i in range(3))

    def loss(q, k, v):
      out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
      return out.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2)), (q, k, v)

  return Case("attention", f"T {seq}, D {head_dim}, fwd+bwd", build, "TFLOP/s")


def _linear(m: int, k: int, n: int, use_fp8: bool) -> Case:
  def build():
    x, w = _normal((m, k)), _normal((k, n), seed=1) * k**-0.5
    product = (lambda a, b: fp8.einsum("mk,kn->mn", a, b)) if use_fp8 else jnp.matmul
    loss = lambda a, b: product(a, b).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1)), (x, w)

  name = "FP8" if use_fp8 else "bf16"
  return Case("gemm", f"{m} x {k} x {n}, {name}, fwd+bwd", build, "TFLOP/s")


def _experts(experts: int, tokens_each: int, d_model: int, width: int) -> Case:
  def build():
    x = _normal((experts, tokens_each, d_model))
    w = _normal((experts, d_model, width), seed=1) * d_model**-0.5
    loss = lambda a, b: jnp.einsum("ecd,edf->ecf", a, b).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1)), (x, w)

  shape = f"{experts} x [{tokens_each}, {d_model}] x [{d_model}, {width}], fwd+bwd"
  return Case("experts", shape, build, "TFLOP/s")


def _reduce(rows: int, cols: int, kind: str) -> Case:
  def build():
    x = _normal((rows, cols))
    if kind == "amax":
      return (lambda a: jnp.max(jnp.abs(a)).astype(jnp.float32)), (x,)
    return (lambda a: jnp.sum(a.astype(jnp.float32) ** 2, axis=-1)), (x,)

  return Case("reduce", f"[{rows}, {cols}] bf16, {kind}", build, "GB/s")


def cases(dry_run: bool) -> list[Case]:
  if dry_run:  # the same programs, tiny, XLA's attention
    return [
      _attention(256, 128, 2, 32, False),
      _linear(128, 256, 128, False),
      _linear(128, 256, 128, True),
      _experts(4, 32, 64, 32),
      _reduce(256, 512, "amax"),
      _reduce(256, 512, "row sum of squares"),
    ]
  return [
    *(_attention(16384, seq, 16, 128, True) for seq in (2048, 4096, 8192)),
    _attention(16384, 4096, 16, 192, True),
    # GPT-3 175B under TP 8 (QKV 12,288 -> 4,608; FFN 12,288 -> 6,144), 2,048 tokens a
    # micro-batch; Llama 3.1 405B under TP 8 (FFN 16,384 -> 6,656), 8,192 tokens.
    *(_linear(2048, 12288, n, f) for n in (4608, 6144) for f in (False, True)),
    *(_linear(8192, 16384, 6656, f) for f in (False, True)),
    # DeepSeek-V3's experts, 8 on a GPU of EP 32, up-projection (d_model 7,168, width 2,048).
    *(_experts(8, c, 7168, 2048) for c in (128, 512, 2048, 4096)),
    _reduce(16384, 12288, "amax"),
    _reduce(16384, 12288, "row sum of squares"),
  ]


def median_s(fn, operands: tuple, iters: int) -> float:
  """The median seconds of `iters` calls of fn(*operands), after one untimed call."""
  jax.block_until_ready(fn(*operands))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*operands))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def run_case(case: Case, hw: catalog.Hardware, iters: int) -> dict:
  fn, operands = case.build()
  compiled = jax.jit(fn).lower(*operands).compile()
  program = hlo.analyze(compiled.as_text())
  projected_s = sum(op.seconds for op in projected_ops(program, hw).values())
  measured_s = median_s(compiled, operands, iters)
  if case.rate == "TFLOP/s":
    amount = hlo.dot_flops(program) / 1e12
  else:
    compute = [(n, t) for n, t in hlo.walk(program) if isinstance(n, hlo.Compute)]
    amount = sum((n.bytes_read + n.bytes_written) * t for n, t in compute) / 1e9
  return {
    "family": case.family,
    "shape": case.shape,
    "measured_s": measured_s,
    "projected_s": projected_s,
    "error": projected_s / measured_s - 1,
    "rate_unit": case.rate,
    "measured_rate": amount / measured_s,
    "projected_rate": amount / projected_s if projected_s > 0 else None,
  }


def table(records: list[dict]) -> list[str]:
  lines = [
    "| family | case | measured ms | projected ms | error | measured rate | projected rate |",
    "|" + "---|" * 7,
  ]
  for r in records:
    if "failure" in r:
      lines.append(f"| {r['family']} | {r['shape']} | {r['failure']} | | | | |")
      continue
    unit = r["rate_unit"]
    lines.append(
      f"| {r['family']} | {r['shape']} | {ms(r['measured_s'])} | {ms(r['projected_s'])} | "
      f"{ratio(r['projected_s'], r['measured_s'])} | {_rate(r['measured_rate'])} {unit} | "
      f"{_rate(r['projected_rate'])} {unit} |"
    )
  return lines


def _rate(value: float | None) -> str:
  if value is None:
    return "-"
  return f"{value:,.0f}" if value >= 10 else f"{value:.3g}"


def main(argv: list[str]) -> int:
  parser = Parser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--output_dir", default=os.path.join("runs", "kernel_check"))
  parser.add_argument("--dry_run", action="store_true", help="host CPU, tiny sizes")
  parser.add_argument("--hardware", default=None, help="catalog entry to project onto")
  parser.add_argument("--iters", type=int, default=20, help="timed runs (default: %(default)s)")
  args = parser.parse_args(argv)
  if args.iters < 1:
    parser.error(f"--iters must be at least 1, got {args.iters}")
  device = jax.devices("cpu" if args.dry_run else None)[0]
  if not args.dry_run and device.platform != "gpu":
    parser.error(f"no GPU here (jax sees {device.platform} devices); run with --dry_run")
  name = args.hardware or catalog_entry_for(device.device_kind)
  try:
    hw = catalog.get(name)
  except ValueError as e:
    parser.error(f"--hardware: {e}")
  os.makedirs(args.output_dir, exist_ok=True)
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  header = (
    f"{device.device_kind} ({device.platform}), jax {jax.__version__}; projected onto "
    f"`{hw.name}` ({hw.description}); median of {args.iters} runs."
  )
  print(header, flush=True)
  records = []
  for case in cases(args.dry_run):
    try:
      record = run_case(case, hw, args.iters)
    except Exception as e:  # pylint: disable=broad-except (recorded; the others still run)
      text = str(e).strip().splitlines()
      record = {"family": case.family, "shape": case.shape, "failure": text[0] if text else ""}
    record.update(device_kind=device.device_kind, jax_version=jax.__version__, time=stamp)
    with open(os.path.join(args.output_dir, JSONL), "a") as f:
      f.write(json.dumps(record) + "\n")
    records.append(record)
    print("  " + table([record])[-1], flush=True)
  lines = [f"# kernel_check {stamp}", "", header, "", *table(records)]
  with open(os.path.join(args.output_dir, MARKDOWN), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines[2:]))
  return 1 if any("failure" in r for r in records) else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
