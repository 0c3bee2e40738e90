"""What jax.lax.ragged_dot compiles to for a deviceless CUDA target: a grouped GEMM, or not.

model/moe.py runs the experts as capacity-buffer einsums; this is the check behind that
choice. One expert layer's up-projection at DeepSeek-V3's shapes on one GPU of an EP 32
layout (tokens M, d_model K, expert width N, G experts on the GPU) is differentiated and
compiled for --hardware (jax 0.10.2's CUDA plugin, no GPU needed); the script prints the
compiled program's dot FLOPs (projection/hlo.py) against the grouped GEMMs' 2 M K N each.

  python benchmarks/ragged_dot_check.py [--hardware=h100] [--tokens=4096] [--groups=32]
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
os.environ["JAX_PLATFORMS"] = "cpu"

import platform_env  # noqa: E402

platform_env.configure(host_devices=1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from projection import hlo, targets  # noqa: E402
from projection.aot_compile import FAST_BACKEND  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--hardware", default="h100")
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--d_model", type=int, default=7168)
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--groups", type=int, default=32)
  args = parser.parse_args()
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


if __name__ == "__main__":
  main()
