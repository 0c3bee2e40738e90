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

Scaling of activations and gradients is *current* by default (model.fp8_amax_history 0):
the amax of the tensor being cast, computed in the same step, one max-reduction pass
over the tensor before its cast (a scalar all-reduce when the operand is sharded).
With model.fp8_amax_history N > 0 it is *delayed*, Transformer Engine's recipe in the
published MLPerf runs (`DelayedScaling`: amax_history_len 1024, amax_compute_algo "max"
by default, TE 1.x-2.x API docs): each cast uses a scale from the largest amax of the last
N steps, so it need not wait for a pass over the tensor and can fuse into the op that
produces it; the tensor's amax is still taken (a reduction XLA can fuse alongside, and
off the critical path) and recorded for the steps to come. A `CastWeight` then carries
the two scales (`x_scale`, `g_scale`),
and the backward pass returns the observed amaxes as their cotangents: every code path
that differentiates the layers brings them out as it brings out weight gradients, and
combines the micro-batches' and replicas' amaxes with max (train/step.py,
parallelism/one_f_one_b.py), and the tensor and context ranks' (parallelism/sequence.py,
or the partitioner's max over a sharded tensor). The first step's history is empty and
casts at scale 1, as Transformer Engine's does.

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
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

from parallelism.sequence import Tensor

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


def _scale(amax: jax.Array, dtype) -> jax.Array:
  """The float32 scale that maps the largest magnitude to dtype's largest finite value."""
  amax = amax.astype(jnp.float32)
  return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)


def _amax(x: jax.Array) -> jax.Array:
  """x's largest magnitude, float32. Under delayed scaling it is also what a cast records,
  as the cotangent of its scale; in sequence parallelism's shard_map x may be a shard, and
  parallelism/sequence.py keeps the largest of the ranks' cotangents (tensor and context)."""
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _quantize(
  x: jax.Array, dtype, reduce: Callable[[jax.Array], jax.Array] | None = None
) -> tuple[jax.Array, jax.Array]:
  """x as `dtype` and the float32 scale that restores it (x ~= q * scale); with reduce,
  x is a shard, scaled by reduce(its amax): the amax of the shards of a group
  (parallelism/sequence.py `Tensor`)."""
  amax = _amax(x)
  scale = _scale(reduce(amax) if reduce else amax, dtype)
  return fp8_ops.quantize(x, dtype, scale, jnp.float32), scale


class CastWeight(NamedTuple):
  """A weight [..., ] with its E4M3 cast and the cast's float32 scale (w ~= cast * scale);
  under delayed scaling also the scales its matmul casts the input (E4M3) and the output
  gradient (E5M2) with, whose cotangents are the amaxes observed."""

  weight: jax.Array
  cast: jax.Array
  scale: jax.Array
  x_scale: jax.Array | None = None
  g_scale: jax.Array | None = None


# Amax history layout: [L, 2, N] per kernel, row 0 the matmul input's, row 1 its output
# gradient's, newest first (Transformer Engine rolls its history the same way).
_INPUT, _GRADIENT = 0, 1


class AmaxHistory(nnx.Variable):
  """A kernel's amax history [L, 2, N] (delayed scaling); part of the train state, not a
  parameter: the step overwrites it rather than the optimizer updating it."""


def new_history(layers: int, length: int, stack_axis: str) -> AmaxHistory:
  return AmaxHistory(jnp.zeros((layers, 2, length), jnp.float32), axes=(stack_axis, None, None))


def delayed_scales(history: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A kernel's history [L, 2, N] -> the input's and the gradient's scales [L] for this step."""
  amax = jnp.max(history, axis=-1)
  return _scale(amax[:, _INPUT], E4M3), _scale(amax[:, _GRADIENT], E5M2)


def record(history: jax.Array, amaxes: tuple[jax.Array, jax.Array]) -> jax.Array:
  """The history [L, 2, N] with this step's (input, gradient) amaxes [L] pushed in front."""
  newest = jnp.stack(amaxes, axis=1)[..., None]  # [L, 2, 1]
  return jnp.concatenate([newest, history[..., :-1]], axis=-1)


def cast_weights(stack: jax.Array, scales: tuple[jax.Array, jax.Array] | None = None) -> CastWeight:
  """A layer-stacked weight [L, ...] with its E4M3 cast, scaled per layer (scale [L]); with
  scales (delayed scaling, each [L]), those of its matmuls' inputs and output gradients."""
  constant = jax.lax.stop_gradient(stack)
  layer_axes = tuple(range(1, stack.ndim))
  scale = _scale(jnp.max(jnp.abs(constant), axis=layer_axes), E4M3)  # [L]
  per_layer = scale.reshape(-1, *(1,) * len(layer_axes))
  cast = fp8_ops.quantize(constant, E4M3, per_layer, jnp.float32)
  return CastWeight(stack, cast, scale, *(scales or (None, None)))


def _fp8_einsum(spec: str, a: jax.Array, b: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  out = jnp.einsum(spec, a, b, preferred_element_type=dtype)
  return (out.astype(jnp.float32) * scale).astype(dtype)


def einsum(
  spec: str, x: jax.Array, w: jax.Array | CastWeight, tensor: Tensor | None = None
) -> jax.Array:
  """jnp.einsum(spec, x, w) with FP8 operands; spec has two operands and each index of an
  operand appears in the other operand or the output (true of every weight matmul). w is
  cast here unless it is a CastWeight already; a CastWeight with x_scale and g_scale
  scales by them (delayed scaling).

  tensor: the tensor-parallel group the matmul runs in, inside sequence parallelism's
  shard_map (parallelism/sequence.py `Tensor`). At a region's entry x is this rank's
  sequence shard: it is cast with one scale for every shard and all-gathered as E4M3,
  half the bytes of bfloat16 (Transformer Engine's FP8 all-gather), and the input
  gradient is reduce-scattered back to the shard. At its exit the product is
  reduce-scattered, and the output gradient, a shard, is cast with one scale and
  all-gathered as E5M2. Elsewhere (x at the exit, the output gradient at the entry) a
  tensor rank casts with its own amax, taken over its context ranks, which hold the same
  features of other tokens.
  """
  if not isinstance(w, CastWeight):
    w = CastWeight(w, *_quantize(jax.lax.stop_gradient(w), E4M3))
  return _cast_einsum(spec, tensor, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cast_einsum(spec: str, tensor: Tensor | None, x: jax.Array, w: CastWeight) -> jax.Array:
  return _forward(spec, tensor, x, w)[0]


def _forward(spec, tensor, x, w):
  entry = tensor is not None and tensor.entry
  exit_ = tensor is not None and tensor.exit
  if w.x_scale is None:
    reduce = None if tensor is None else tensor.amax if entry else tensor.context_amax
    xq, x_scale = _quantize(x, E4M3, reduce)
    x_amax = None
  else:
    xq, x_scale = fp8_ops.quantize(x, E4M3, w.x_scale, jnp.float32), w.x_scale
    x_amax = _amax(x)

  if entry:
    xq = tensor.gather(xq)  # the E4M3 shards
  out = _fp8_einsum(spec, xq, w.cast, x_scale * w.scale, x.dtype)
  if exit_:
    out = tensor.scatter(out)
  return out, (xq, x_scale, w.cast, w.scale, w.g_scale, x_amax)


def _backward(spec, tensor, residuals, g):
  xq, x_scale, wq, w_scale, g_scale, x_amax = residuals
  entry = tensor is not None and tensor.entry
  exit_ = tensor is not None and tensor.exit
  if g_scale is None:
    # At an exit g is this rank's sequence shard, gathered below with one scale.
    reduce = None if tensor is None else tensor.amax if exit_ else tensor.context_amax
    gq, g_scale = _quantize(g, E5M2, reduce)
    g_amax = None
  else:
    gq, g_amax = fp8_ops.quantize(g, E5M2, g_scale, jnp.float32), _amax(g)
  inputs, out = spec.split("->")
  x_axes, w_axes = inputs.split(",")

  if exit_:
    gq = tensor.gather(gq)  # the E5M2 shards
  dx = _fp8_einsum(f"{out},{w_axes}->{x_axes}", gq, wq, g_scale * w_scale, g.dtype)
  if entry:
    dx = tensor.scatter(dx)
  dw = _fp8_einsum(f"{x_axes},{out}->{w_axes}", xq, gq, x_scale * g_scale, g.dtype)
  # The cast and its scale are constants of the step: the gradient is the weight's; the
  # activation scales' "gradients" are the amaxes observed.
  return dx, CastWeight(dw, None, None, x_amax, g_amax)


_cast_einsum.defvjp(_forward, _backward)


def split_casts(params: dict) -> tuple[dict, dict, dict]:
  """Layer parameters -> (the arrays to differentiate, {name: (cast, scale)} of the
  CastWeights among them, {name: (x_scale, g_scale)} of those scaled by delay): a
  hand-written backward pass (parallelism/one_f_one_b.py) accumulates gradients for the
  first, nothing for the second and the maximum amax observed for the third."""
  weights = {k: v.weight if isinstance(v, CastWeight) else v for k, v in params.items()}
  casts = {k: (v.cast, v.scale) for k, v in params.items() if isinstance(v, CastWeight)}
  scales = {
    k: (v.x_scale, v.g_scale)
    for k, v in params.items()
    if isinstance(v, CastWeight) and v.x_scale is not None
  }
  return weights, casts, scales


def with_casts(weights: dict, casts: dict, scales: dict) -> dict:
  """The inverse of split_casts."""
  return {
    k: CastWeight(w, *casts[k], *scales.get(k, (None, None))) if k in casts else w
    for k, w in weights.items()
  }
