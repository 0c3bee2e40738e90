"""FP8 weight matmuls: E4M3 operands forward, E5M2 gradients backward, scaled per tensor.

`einsum(spec, x, w)` stands in for `jnp.einsum` on the four weight matmuls of a block.
Both operands are scaled so their largest magnitude lands on the format's largest finite
value, cast to float8_e4m3fn (3 mantissa bits: precision for activations and weights),
and multiplied as FP8 with a float32 accumulator; the product is unscaled. The backward
pass casts the incoming gradient to float8_e5m2 (2 mantissa bits, 5 exponent bits: range
for gradients) and runs both gradient matmuls on FP8 operands too, so XLA sees f8 dot
operands in all three matmuls of every weight, as an FP8 GEMM runs them on Hopper and
Blackwell (the E4M3 / E5M2 "hybrid" recipe of Micikevicius et al. 2022,
arXiv:2209.05433).

Scaling is *current* (the amax of the tensor being cast, computed in the same step), not
Flax's delayed scaling (`flax.linen.fp8_ops`: an amax history carried between steps as
mutable per-matmul state whose "gradient" is its next value). That state would have to be
stacked per layer, threaded through the layer scan and the pipeline loop, and kept out
of AdamW; current scaling needs no state at the cost of one max-reduction per operand
(a scalar all-reduce when the operand is sharded). The casts themselves are Flax's
(`fp8_ops.quantize`), so saturation and rounding match Flax's FP8 path.

Weights are cast once a step (`cast_weights`, on the whole layer stack, one scale per
layer), not in every matmul: the layer scan and the pipeline loop then read one byte per
weight element per use instead of reading bfloat16, reducing it to an amax and writing
FP8 again on every layer call and every pipeline trip (Transformer Engine caches its
weight casts across micro-batches for the same reason). A `CastWeight` carries the
bfloat16 weight along with its cast: the forward pass reads only the cast, and the weight
gradient flows to the bfloat16 weight.

Products are returned in the compute dtype (an FP8 GEMM writes bfloat16 directly), so
the matmul outputs the remat policy saves for the backward pass are half the size of
float32 ones.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from parallelism.sequence import Gather

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


def _scale(amax: jax.Array, dtype) -> jax.Array:
  """The float32 scale that maps the largest magnitude to dtype's largest finite value."""
  amax = amax.astype(jnp.float32)
  return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)


def _quantize(x: jax.Array, dtype, gather: Gather | None = None) -> tuple[jax.Array, jax.Array]:
  """x as `dtype` and the float32 scale that restores it (x ~= q * scale); with a gather,
  x is a shard, scaled by the amax of every shard."""
  amax = jnp.max(jnp.abs(x))
  scale = _scale(gather.amax(amax) if gather else amax, dtype)
  return fp8_ops.quantize(x, dtype, scale, jnp.float32), scale


class CastWeight(NamedTuple):
  """A weight [..., ] with its E4M3 cast and the cast's float32 scale (w ~= cast * scale)."""

  weight: jax.Array
  cast: jax.Array
  scale: jax.Array


def cast_weights(stack: jax.Array) -> CastWeight:
  """A layer-stacked weight [L, ...] with its E4M3 cast, scaled per layer (scale [L])."""
  constant = jax.lax.stop_gradient(stack)
  layer_axes = tuple(range(1, stack.ndim))
  scale = _scale(jnp.max(jnp.abs(constant), axis=layer_axes), E4M3)  # [L]
  per_layer = scale.reshape(-1, *(1,) * len(layer_axes))
  return CastWeight(stack, fp8_ops.quantize(constant, E4M3, per_layer, jnp.float32), scale)


def _fp8_einsum(spec: str, a: jax.Array, b: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  out = jnp.einsum(spec, a, b, preferred_element_type=dtype)
  return (out.astype(jnp.float32) * scale).astype(dtype)


def einsum(
  spec: str, x: jax.Array, w: jax.Array | CastWeight, gather: Gather | None = None
) -> jax.Array:
  """jnp.einsum(spec, x, w) with FP8 operands; spec has two operands and each index of an
  operand appears in the other operand or the output (true of every weight matmul). w is
  cast here unless it is a CastWeight already.

  gather: sequence parallelism's entry into a tensor-parallel region (parallelism/sequence.py
  `Gather`), x being this rank's sequence shard. x is cast with the amax of every shard and
  all-gathered as E4M3, half the bytes of bfloat16 (Transformer Engine's FP8 all-gather);
  the input gradient is reduce-scattered back to the shard.
  """
  if not isinstance(w, CastWeight):
    w = CastWeight(w, *_quantize(jax.lax.stop_gradient(w), E4M3))
  return _cast_einsum(spec, gather, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cast_einsum(spec: str, gather: Gather | None, x: jax.Array, w: CastWeight) -> jax.Array:
  return _forward(spec, gather, x, w)[0]


def _forward(spec, gather, x, w):
  xq, x_scale = _quantize(x, E4M3, gather)
  if gather is not None:
    xq = gather.gather(xq)
  return _fp8_einsum(spec, xq, w.cast, x_scale * w.scale, x.dtype), (xq, x_scale, w.cast, w.scale)


def _backward(spec, gather, residuals, g):
  xq, x_scale, wq, w_scale = residuals
  gq, g_scale = _quantize(g, E5M2)
  inputs, out = spec.split("->")
  x_axes, w_axes = inputs.split(",")
  dx = _fp8_einsum(f"{out},{w_axes}->{x_axes}", gq, wq, g_scale * w_scale, g.dtype)
  dw = _fp8_einsum(f"{x_axes},{out}->{w_axes}", xq, gq, x_scale * g_scale, g.dtype)
  if gather is not None:
    dx = gather.scatter(dx)
  # The cast and its scale are constants of the step: the gradient is the weight's.
  return dx, CastWeight(dw, None, None)


_cast_einsum.defvjp(_forward, _backward)


def split_casts(params: dict) -> tuple[dict, dict]:
  """Layer parameters -> (the arrays to differentiate, {name: (cast, scale)} of the
  CastWeights among them): a hand-written backward pass (parallelism/one_f_one_b.py)
  accumulates gradients for the first only."""
  weights = {k: v.weight if isinstance(v, CastWeight) else v for k, v in params.items()}
  casts = {k: (v.cast, v.scale) for k, v in params.items() if isinstance(v, CastWeight)}
  return weights, casts


def with_casts(weights: dict, casts: dict) -> dict:
  """The inverse of split_casts."""
  return {k: CastWeight(w, *casts[k]) if k in casts else w for k, w in weights.items()}
