"""What jax.lax.ragged_dot compiles to for a CUDA target: a grouped GEMM, or not.

model/moe.py runs the experts as capacity-buffer einsums; this is the check behind that
choice. One expert layer's up-projection at DeepSeek-V3's shapes on one GPU of an EP 32
layout (tokens M, d_model K, expert width N, G experts on the GPU, tokens split evenly) is
differentiated and compiled for --hardware (jax 0.10.2's CUDA plugin, no GPU needed); the
script prints the compiled program's dot FLOPs (projection/hlo.py) against the grouped
GEMMs' 2 M K N each.

With --measure, on a machine with an NVIDIA GPU, the same three ways of running the
grouped GEMM are compiled for that GPU and timed (forward + backward, median of --iters):
ragged_dot, the capacity-buffer einsum model/moe.py runs ([G, M / G, K] x [G, K, N]), and
one dense [M, K] x [K, N] GEMM of the same FLOPs, the reference a grouped GEMM should reach.

  python benchmarks/ragged_dot_check.py [--hardware=h100] [--tokens=4096] [--groups=32]
  python benchmarks/ragged_dot_check.py --measure            # on a GPU
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
if "--measure" not in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"  # deviceless: the CUDA target compiles on the CPU

import platform_env  # noqa: E402

platform_env.configure(host_devices=1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from benchmarks.gpu_check import Parser  # noqa: E402
from benchmarks.kernel_check import median_s  # noqa: E402
from projection import hlo, targets  # noqa: E402
from projection.aot_compile import FAST_BACKEND  # noqa: E402


def main() -> None:
  parser = Parser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--hardware", default="h100")
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--d_model", type=int, default=7168)
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--groups", type=int, default=32)
  parser.add_argument("--measure", action="store_true", help="time the three on this GPU")
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  if args.measure:
    if jax.devices()[0].platform != "gpu":
      parser.error(f"--measure needs a GPU; jax sees {jax.devices()[0].platform} devices")
    if args.tokens % args.groups or min(args.tokens, args.groups, args.iters) < 1:
      parser.error(
        f"--tokens {args.tokens} must be a positive multiple of --groups {args.groups}, "
        f"--iters {args.iters} positive"
      )
    measure(args)
    return
  ok, reason = targets.cuda_available()
  if not ok:
    sys.exit(f"no CUDA target: {reason}")
  M, K, N, G = args.tokens, args.d_model, args.width, args.groups
  mesh = Mesh(np.asarray(targets.target_devices(args.hardware, 1, 1)).reshape(1), ("x",))
  spec = NamedSharding(mesh, PartitionSpec())
  shapes = (
    jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=spec),
    jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16, sharding=spec),
    jax.ShapeDtypeStruct((G,), jnp.int32, sharding=spec),
  )
  loss = lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes).astype(jnp.float32).sum()
  grouped = 2 * M * K * N  # one grouped GEMM
  print(f"ragged_dot [{M}, {K}] x [{G}, {K}, {N}] on {args.hardware}")
  for name, fn, matmuls in (
    ("forward", loss, 1),
    ("forward + backward", jax.value_and_grad(loss, argnums=(0, 1)), 3),
  ):
    compiled = jax.jit(fn).lower(*shapes).compile(FAST_BACKEND)
    flops = hlo.dot_flops(hlo.analyze(compiled.as_text()))
    print(
      f"  {name}: compiled dot FLOPs {flops / 1e9:,.0f} G against {matmuls} grouped GEMMs' "
      f"{matmuls * grouped / 1e9:,.0f} G: {flops / (matmuls * grouped):.1f}x"
    )


def measure(args: argparse.Namespace) -> None:
  """The three ways timed on this GPU (main() has checked there is one and M % G == 0)."""
  device = jax.devices()[0]
  M, K, N, G = args.tokens, args.d_model, args.width, args.groups
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
  w = jax.random.normal(keys[1], (G, K, N), jnp.bfloat16) * K**-0.5
  sizes = jnp.full((G,), M // G, jnp.int32)  # balanced routing
  x_buf = x.reshape(G, M // G, K)  # [G, C, K]: every slot filled
  w_dense = w[0]

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda *a: fn(*a).astype(jnp.float32).sum(), (0, 1)))

  ways = (
    ("ragged_dot", loss(jax.lax.ragged_dot), (x, w, sizes)),
    ("capacity einsum", loss(lambda a, b: jnp.einsum("gck,gkn->gcn", a, b)), (x_buf, w)),
    ("dense GEMM (reference)", loss(jnp.matmul), (x, w_dense)),
  )
  flops = 3 * 2 * M * K * N  # forward and the two backward GEMMs
  print(
    f"{device.device_kind}, jax {jax.__version__}: [{M}, {K}] x [{G}, {K}, {N}], "
    f"balanced, forward + backward ({flops / 1e9:,.0f} GFLOP of grouped GEMMs)"
  )
  for name, fn, operands in ways:
    compiled = fn.lower(*operands).compile()  # once: its text and the executable timed
    dot = hlo.dot_flops(hlo.analyze(compiled.as_text()))
    seconds = median_s(compiled, operands, args.iters)
    print(
      f"  {name:24s} {seconds * 1e3:8.3f} ms  {flops / seconds / 1e12:6.0f} TFLOP/s  "
      f"compiled dot FLOPs {dot / flops:.1f}x the grouped GEMMs'"
    )


if __name__ == "__main__":
  main()
