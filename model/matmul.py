"""The block's weight matmuls, with weight gradients that XLA:CPU runs through YNNPACK.

`einsum(spec, x, w)` is `jnp.einsum(spec, x, w)` for x [tokens..., in...] and w [in...,
out...]. Autodiff's weight gradient contracts x and the output gradient over their
leading (token) axes. XLA:CPU (jax 0.10.2) sends such a dot, when both operands keep that
axis major (the MLP's two in cpu_gpt2_small), to its Eigen dot instead of YNNPACK, at about
half the rate (44 against 83 GFLOP/s on one core of this repo's host for 1024 x 768 x 3072).
On CPU the backward pass here transposes the narrower operand explicitly (optimization
barriers keep XLA from folding the transposes back into the dot), so the dot is a plain
row-major matmul that YNNPACK takes: about 7% off a cpu_gpt2_small step. Other platforms
lower the gradient autodiff would write, and so do sharded steps (see _backward).
"""

import functools
import math

import jax
import jax.numpy as jnp


def split(spec: str) -> tuple[str, str, str]:
  inputs, out = spec.split("->")
  x, w = inputs.split(",")
  return x, w, out


def weight_axes(spec: str) -> tuple[str, str, str] | None:
  """(token, contracted, output) axes of a weight matmul's spec when it is
  [tokens, in] x [in, out] -> [tokens, out] (every matmul of the block), else None."""
  xs, ws, out = split(spec)
  tokens = "".join(a for a in xs if a not in ws)
  contracted, features = xs[len(tokens) :], out[len(tokens) :]
  if xs != tokens + contracted or ws != contracted + features or out != tokens + features:
    return None
  return tokens, contracted, features


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """jnp.einsum(spec, x, w) for a weight matmul (each index of an operand appears in the
  other operand or the output)."""
  return jnp.einsum(spec, x, w)


def _forward(spec, x, w):
  return jnp.einsum(spec, x, w), (x, w)


def _backward(spec, residuals, g):
  x, w = residuals
  xs, ws, out = split(spec)
  dx = jnp.einsum(f"{out},{ws}->{xs}", g, w)

  def autodiff(x, g):
    return jnp.einsum(f"{xs},{out}->{ws}", x, g)

  axes = weight_axes(spec)
  if axes is None:
    return dx, autodiff(x, g)  # not [tokens, in] x [in, out]: autodiff's form
  tokens = len(axes[0])
  if jax.sharding.get_abstract_mesh().size > 1:
    # Sharded: flattening the token axes and the explicit transposes would make the SPMD
    # partitioner regather operands (an all-gather appears in a pipelined tensor-parallel
    # step); autodiff's form keeps its choices. The gain above is for one device.
    return dx, autodiff(x, g)

  def row_major(x, g):
    rows = math.prod(x.shape[:tokens])
    x, g = x.reshape(rows, -1), g.reshape(rows, -1)
    # Transpose the narrower operand; the barriers keep XLA from folding the transposes back
    # into the dot. (Transposing the MLP's wide input would also pull the GELU recomputed
    # for the backward pass into the transpose's strided loop, several times slower.)
    if x.shape[1] <= g.shape[1]:
      dw = jax.lax.optimization_barrier(x.T) @ g
    else:
      dw = jax.lax.optimization_barrier(jax.lax.optimization_barrier(g.T) @ x).T
    return dw.reshape(w.shape)

  dw = jax.lax.platform_dependent(x, g, cpu=row_major, default=autodiff)
  return dx, dw.astype(w.dtype)


einsum.defvjp(_forward, _backward)
