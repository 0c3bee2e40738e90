"""Block-scaled weight matmuls: Blackwell's MXFP8 and NVFP4, forward and backward.

`einsum(spec, x, w, fmt)` stands in for `jnp.einsum` on the block's weight matmuls (QKV,
attention output, MLP, latent attention's projections, model/mla.py), as model/fp8.py's
does for per-tensor FP8, and on a stack of routed experts' (model/moe.py), whose expert
axis is a batch axis: one GEMM an expert, each expert's operands quantized apart. All
three GEMMs of each (the forward, and the input and weight gradients) take block-scaled
operands, each quantized along that GEMM's contraction axis, with a float32 accumulator;
outputs are in the compute dtype. The rest of the model (embedding, output head, norms,
the MoE router, attention's softmax and its two batched matmuls) stays in the compute
dtype (the router in float32), as in the published recipes; the output head is
block-scaled too with model.block_scaled_head (GB300's DeepSeek-V3 configs: an MXFP8 LM
head), its weight quantized in each call.

Formats (`FORMATS`; the OCP Microscaling spec for MXFP8, NVIDIA's for NVFP4):
- mxfp8: E4M3 values, one power-of-two E8M0 scale per 32 values along the contraction
  axis. Transformer Engine's MXFP8BlockScaling uses E4M3 for gradients too, and so does
  this (and jax.nn.scaled_dot_general's "mxfp8" config).
- nvfp4: E2M1 values (one mantissa bit, magnitudes 0-6), one E4M3 scale per 16 values,
  and a float32 scale per tensor, amax / (448 x 6), so that the block scales use E4M3's
  range (Transformer Engine's NVFP4BlockScaling; "Pretraining Large Language Models with
  NVFP4", arXiv:2509.25149, section 4). Weights are scaled in 16 x 16 tiles (2D), so the
  forward and the input-gradient GEMMs see the same quantized weight; activations and
  gradients in 1 x 16 blocks.
  Not followed from that recipe: stochastic rounding of gradients (round-to-nearest-even
  here), the random Hadamard transform of the weight-gradient GEMM's inputs, and keeping
  the first and last few layers in BF16 (the layer stack is one scanned program here, so
  every layer runs one format).

Weights are quantized once a step (`quantize_weights`, on the whole layer stack, carried
in a model/fp8.py `CastWeight` as FP8's casts are), not in every matmul call: the layer
scan and the pipeline loops then read the stored values and scales instead of quantizing
every weight again for each micro-batch, forward and backward (Transformer Engine caches
its weight quantization across micro-batches for the same reason). That needs a kernel's
last contracted and last output axes to split into blocks (`cacheable`: every kernel of
the GPT-3, Llama and DeepSeek-V3 shapes, the expert stacks [L, E, in, out] included);
other kernels are quantized in each call.

On a CUDA target the GEMM is `jax.nn.scaled_matmul`, which XLA compiles to cuDNN's
block-scaled matmul (`__cudnn$blockScaledDot`) for Blackwell when the target's cuDNN is
9.10 or newer (docs/blackwell_formats.md). Elsewhere (CPU) it is emulated: the quantized
operands are dequantized and multiplied in float32, which gives the same numbers up to
the accumulation order.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax._src.cudnn import scaled_matmul_stablehlo as cudnn_gemm  # jax 0.10.2's primitive
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserInputError
from model import fused_quantize
from model import matmul as dense
from model.fp8 import CastWeight

FORMAT_NAMES = ("mxfp8", "nvfp4")
# The name each matmul's output carries, so that remat policies which keep matmul outputs
# (model/gpt.py `none`, `save_dots`) keep these too: they are custom calls, not dots.
OUTPUT_NAME = "block_scaled_matmul"
# Matmuls with batch axes (a stack of experts'): saved where batched dots are (`none`), not
# where only dots without batch dimensions are (`save_dots`).
BATCHED_OUTPUT_NAME = "block_scaled_batched_matmul"


@dataclasses.dataclass(frozen=True)
class Format:
  name: str
  values: type  # element type of the quantized values
  scales: type  # element type of the block scales
  block: int  # values per scale, along the contraction axis
  value_max: float  # largest finite value of `values`
  weight_tile: int  # rows of a weight's scale tile: `block` for 2D scaling, else 1


FORMATS = {
  "mxfp8": Format(
    "mxfp8", jnp.float8_e4m3fn, jnp.float8_e8m0fnu, fused_quantize.BLOCK["mxfp8"], 448.0, 1
  ),
  "nvfp4": Format(
    "nvfp4", jnp.float4_e2m1fn, jnp.float8_e4m3fn, fused_quantize.BLOCK["nvfp4"], 6.0, 16
  ),
}
_E4M3_MAX = fused_quantize.E4M3_MAX


class Quantized(NamedTuple):
  """a [R, K] ~= values * repeat(scales, block, axis=1) * global_scale."""

  values: jax.Array  # [R, K] in fmt.values
  scales: jax.Array  # [R, K / block] in fmt.scales
  global_scale: jax.Array  # float32 scalar (1 for MXFP8)


def _check_blocks(R: int, K: int, fmt: Format, tile_rows: int) -> None:
  if K % fmt.block or R % tile_rows:
    raise UserInputError(
      f"model.block_scaling = {fmt.name}: a [{R}, {K}] matmul operand does not split into "
      f"{tile_rows} x {fmt.block} blocks; each matmul's widths (per tensor rank) and tokens "
      f"per micro-batch (an expert's: sequences x capacity slots) must be multiples of "
      f"{fmt.block}"
    )


def nvfp4_global_scale(amax: jax.Array) -> jax.Array:
  """NVFP4's per-tensor scale of an operand's amax (float32): its block scales then use
  E4M3's whole range."""
  return jnp.where(amax > 0, amax / (_E4M3_MAX * FORMATS["nvfp4"].value_max), 1.0)


def quantize(a: jax.Array, fmt: Format, tile_rows: int = 1) -> Quantized:
  """a [R, K] in blocks of fmt.block along K, each block's scale shared by `tile_rows` rows
  (16 x 16 tiles for NVFP4 weights)."""
  R, K = a.shape
  _check_blocks(R, K, fmt, tile_rows)
  tiles = a.reshape(R // tile_rows, tile_rows, K // fmt.block, fmt.block)
  # abs and max are exact in the operand's own type: taken there, a pass that reduces the
  # operand reads (and any copy XLA keeps for it holds) bfloat16, not a float32 widening.
  block_amax = jnp.max(jnp.abs(tiles), axis=(1, 3))  # [R / tile_rows, K / block]
  block_amax = block_amax.astype(jnp.float32)
  if fmt.name == "nvfp4":
    global_scale = nvfp4_global_scale(jnp.max(block_amax))
    scales = (block_amax / fmt.value_max / global_scale).astype(fmt.scales)
  else:
    global_scale = jnp.ones((), jnp.float32)
    exponent = jnp.ceil(jnp.log2(jnp.maximum(block_amax, 1e-30) / fmt.value_max))
    scales = jnp.where(block_amax > 0, jnp.exp2(exponent), 1.0).astype(fmt.scales)
  divisor = scales.astype(jnp.float32) * global_scale
  divisor = jnp.where(divisor > 0, divisor, 1.0)[:, None, :, None]
  values = tiles.astype(jnp.float32) / divisor
  values = jnp.clip(values, -fmt.value_max, fmt.value_max).astype(fmt.values)
  return Quantized(
    values.reshape(R, K), jnp.repeat(scales, tile_rows, axis=0), global_scale.astype(jnp.float32)
  )


def both_ways(a: jax.Array, fmt: Format, row_groups: int = 1) -> tuple[Quantized, Quantized]:
  """(quantize(a), quantize(a.T)): an activation or gradient [M, K] along K for the GEMM
  contracting K, and along M for the weight-gradient GEMM. On a CUDA target both in one
  kernel (model/fused_quantize.py), NVFP4's per-tensor scale from an amax taken first;
  row_groups: see `_einsum`."""
  R, K = a.shape
  _check_blocks(R, K, fmt, 1)
  _check_blocks(K, R, fmt, 1)

  def fused(a):
    if fmt.name == "nvfp4":
      scale = nvfp4_global_scale(jnp.max(jnp.abs(a)).astype(jnp.float32))
      quantized = fused_quantize.nvfp4_both_ways(a, scale, row_groups=row_groups)
    else:
      scale = jnp.ones((), jnp.float32)
      quantized = fused_quantize.mxfp8_both_ways(a, row_groups=row_groups)
    by_k, by_k_scales, by_m, by_m_scales = quantized
    return Quantized(by_k, by_k_scales, scale), Quantized(by_m, by_m_scales, scale)

  jnp_passes = lambda a: (quantize(a, fmt), quantize(a.T, fmt))
  return jax.lax.platform_dependent(a, cuda=fused, default=jnp_passes)


def transposed(q: Quantized, fmt: Format) -> Quantized:
  """A 2D-scaled (tile_rows == block) quantization of a [R, K] as one of a.T [K, R]."""
  tiles = q.scales[:: fmt.block]  # [R / block, K / block]
  return Quantized(q.values.T, jnp.repeat(tiles.T, fmt.block, axis=0), q.global_scale)


def dequantize(q: Quantized, fmt: Format) -> jax.Array:
  scales = jnp.repeat(q.scales.astype(jnp.float32), fmt.block, axis=1)
  return q.values.astype(jnp.float32) * scales * q.global_scale


def _dot(a: Quantized, b: Quantized, fmt: Format, dtype) -> jax.Array:
  """a [M, K] . b [N, K]^T -> [M, N] in dtype: cuDNN's block-scaled GEMM on a CUDA target,
  emulated (dequantize, float32 matmul) elsewhere."""

  def cuda(av, bv, a_scales, b_scales):
    # cuDNN writes the compute dtype, as Transformer Engine's GEMMs do: a partitioned GEMM's
    # all-reduce of partial products then moves bf16, not float32 (512 GB200 DeepSeek-V3:
    # 65.5 s a step with float32 outputs, 58.5 s with bf16).
    gemm = _cudnn(jnp.dtype(dtype))
    return gemm(av[None], bv[None], a_scales[None], b_scales[None])[0].astype(jnp.float32)

  def emulated(av, bv, a_scales, b_scales):
    a_full = dequantize(Quantized(av, a_scales, jnp.ones((), jnp.float32)), fmt)
    b_full = dequantize(Quantized(bv, b_scales, jnp.ones((), jnp.float32)), fmt)
    return jnp.einsum("mk,nk->mn", a_full, b_full, preferred_element_type=jnp.float32)

  out = jax.lax.platform_dependent(
    a.values, b.values, a.scales, b.scales, cuda=cuda, default=emulated
  )
  return (out * (a.global_scale * b.global_scale)).astype(dtype)


@functools.cache
def _cudnn(out_type):
  """jax.nn.scaled_matmul on operands [..., M, K] and [..., N, K] whose leading axes are
  batch axes, flattened into its one batch axis; the output in `out_type`."""

  @jax.custom_batching.custom_vmap
  def gemm(av: jax.Array, bv: jax.Array, a_scales: jax.Array, b_scales: jax.Array):
    lead = av.shape[:-2]
    flat = [x.reshape(-1, *x.shape[-2:]) for x in (av, bv, a_scales, b_scales)]
    out = _scaled_matmul(*flat, out_type)[0]
    return out.reshape(*lead, av.shape[-2], bv.shape[-2])

  @gemm.def_vmap
  def _vmap(axis_size, in_batched, av, bv, a_scales, b_scales):
    # scaled_matmul's own batching rule, and its SPMD partitioner, need every operand
    # batched alike. Inside the model's vmaps (data replicas, context ranks, pipeline
    # stages) a weight often is not: the mapped axis then joins the other operand's rows,
    # as a shared weight's matmul batches.
    a_batched, b_batched = in_batched[0], in_batched[1]
    # Scales are made with their values, so they are batched alike.
    assert in_batched[2] == a_batched and in_batched[3] == b_batched, in_batched
    assert a_batched or b_batched, in_batched
    if a_batched and b_batched:
      return gemm(av, bv, a_scales, b_scales), True
    if a_batched:  # [V, ..., M, K] x [..., N, K]: V M rows
      rows = lambda x: jnp.moveaxis(x, 0, -3).reshape(*x.shape[1:-2], -1, x.shape[-1])
      out = gemm(rows(av), bv, rows(a_scales), b_scales)  # [..., V M, N]
      out = out.reshape(*out.shape[:-2], axis_size, -1, out.shape[-1])
      return jnp.moveaxis(out, -3, 0), True
    # [..., M, K] x [V, ..., N, K]: V N columns
    cols = lambda x: jnp.moveaxis(x, 0, -3).reshape(*x.shape[1:-2], -1, x.shape[-1])
    out = gemm(av, cols(bv), a_scales, cols(b_scales))  # [..., M, V N]
    out = out.reshape(*out.shape[:-1], axis_size, -1)
    return jnp.moveaxis(out, -2, 0), True

  return gemm


def _padded(spec, rank: int = 3) -> tuple:
  return (*spec, *(None,) * (rank - len(spec)))


def _mesh_axes(spec_entry) -> set:
  if spec_entry is None:
    return set()
  return {spec_entry} if isinstance(spec_entry, str) else set(spec_entry)


def _gemm_specs(lhs, rhs) -> tuple[tuple, tuple, tuple]:
  """(lhs, rhs, output) specs [B, M, K], [B, N, K], [B, M, N] a partitioned GEMM runs with:
  the batch as lhs's, a contraction split alike in both operands kept (partial products,
  then an all-reduce), M and N kept where they use other mesh axes (M first)."""
  batch, m, k = _padded(lhs.spec)
  _, n, rhs_k = _padded(rhs.spec)
  used = _mesh_axes(batch)
  k = k if k is not None and k == rhs_k and not _mesh_axes(k) & used else None
  used |= _mesh_axes(k)
  m = m if not _mesh_axes(m) & used else None
  used |= _mesh_axes(m)
  n = n if not _mesh_axes(n) & used else None
  return (batch, m, k), (batch, n, k), (batch, m, n)


def _infer(out_type, mesh, shapes, result_shape):
  lhs, rhs = shapes[0].sharding, shapes[1].sharding
  return [NamedSharding(lhs.mesh, P(*_gemm_specs(lhs, rhs)[2]))]


def _partition(out_type, mesh, shapes, result_shape):
  lhs, rhs = shapes[0].sharding, shapes[1].sharding
  lhs_spec, rhs_spec, out_spec = _gemm_specs(lhs, rhs)
  k = lhs_spec[2]

  def local(a, b, a_scales, b_scales):
    out = cudnn_gemm._scaled_matmul_impl(a, b, a_scales, b_scales, out_type)
    return [jax.lax.psum(out[0], k)] if k is not None else out

  named = lambda spec: NamedSharding(lhs.mesh, P(*spec))
  operands = (named(lhs_spec), named(rhs_spec), named(lhs_spec), named(rhs_spec))
  return lhs.mesh, local, [named(out_spec)], operands


@functools.partial(custom_partitioning, static_argnums=(4,))
def _scaled_matmul(av, bv, a_scales, b_scales, out_type) -> list[jax.Array]:
  """jax.nn.scaled_matmul ([B, M, K] x [B, N, K] -> [B, M, N] in out_type) with another SPMD
  partitioning rule. jax 0.10.2's all-reduces a contraction split over mesh axes only when
  the rhs's rows are whole: the weight-gradient GEMM of a column-parallel weight (rows
  split over `tensor`) with its tokens split over `expert` (DeepSeek-V3's attention
  projections and shared experts at 512 GB200) then all-gathers both operands' tokens
  instead, 291 GB a step. Here any contraction split alike in both operands is summed by
  an all-reduce, and M and N keep their splits where they use other mesh axes."""
  return cudnn_gemm._scaled_matmul_impl(av, bv, a_scales, b_scales, out_type)


_scaled_matmul.def_partition(
  infer_sharding_from_operands=_infer,
  partition=_partition,
  sharding_rule="b m k, b n k, b m k, b n k -> b m n",
)


def _weight(w: jax.Array, fmt: Format) -> Quantized:
  """w [K, N] quantized for the forward GEMM, as w.T [N, K] along K."""
  return quantize(w.T, fmt, tile_rows=fmt.weight_tile)


def _by_n(w: jax.Array, forward: Quantized, fmt: Format) -> Quantized:
  """w [K, N] quantized for the input-gradient GEMM, along N: the forward's tiles read the
  other way (2D scaling), else quantized afresh."""
  if fmt.weight_tile > 1:
    return transposed(forward, fmt)
  return quantize(w, fmt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(
  fmt: Format, row_groups: int, x: jax.Array, w: jax.Array, cached: tuple | None
) -> jax.Array:
  """x [M, K] @ w [K, N] -> [M, N] in x.dtype, every GEMM block-scaled; cached: w's
  (forward, input-gradient) quantizations, made once a step (else made here); row_groups:
  how x's rows are grouped (`_einsum`), for the fused quantization."""
  forward = cached[0] if cached is not None else _weight(w, fmt)
  return _dot(quantize(x, fmt), forward, fmt, x.dtype)


def _forward(fmt, row_groups, x, w, cached):
  # The backward pass's residual is the weight-gradient GEMM's quantized x^T rather than
  # x (Transformer Engine's "columnwise" copy). Under the model's remat policies, which
  # save only named activations and matmul outputs, it is recomputed from x there.
  x_by_k, x_by_m = both_ways(x, fmt, row_groups)
  forward = cached[0] if cached is not None else _weight(w, fmt)
  return _dot(x_by_k, forward, fmt, x.dtype), (x_by_m, w, cached)


def _backward(fmt, row_groups, residuals, g):
  x_by_m, w, cached = residuals
  # Input gradient: g [M, N] . w [K, N]^T, contracting N.
  w_by_n = cached[1] if cached is not None else _by_n(w, _weight(w, fmt), fmt)
  g_by_n, g_by_m = both_ways(g, fmt, row_groups)
  dx = _dot(g_by_n, w_by_n, fmt, g.dtype)  # g: the output's dtype, x's
  # Weight gradient: x^T [K, M] . g^T [N, M]^T, contracting the tokens M.
  dw = _dot(x_by_m, g_by_m, fmt, w.dtype)
  # The cached quantizations are constants of the step: the gradient is the weight's.
  return dx, dw, None


_matmul.defvjp(_forward, _backward)


def cacheable(stack_shape: tuple[int, ...], contracted: int, fmt: str, batch: int = 0) -> bool:
  """Whether `quantize_weights` can lay a weight's quantization out like it: its last
  contracted and last output axes split into blocks (else each matmul quantizes it)."""
  b = FORMATS[fmt].block
  return stack_shape[batch + contracted] % b == 0 and stack_shape[-1] % b == 0


def quantize_weights(stack: jax.Array, contracted: int, fmt: str, batch: int = 0) -> CastWeight:
  """A layer-stacked weight [L, batch..., in..., out...] (its first `batch` axes after L
  batch axes of its matmul, as a stack of experts' `e`, then `contracted` contracted axes)
  with, per layer (and batch index), the quantizations its forward and input-gradient GEMMs
  read: CastWeight(stack, cast, global scales [L, batch...]). Each array of `cast` is laid
  out like the weight, a block axis in place of the last `in` (or `out`) axis for the
  scales, so that it shards as the weight does: (values, 16 x 16 tile scales) for NVFP4,
  (values and scales along `in`, values and scales along `out`) for MXFP8."""
  spec = FORMATS[fmt]
  inner = stack.shape[1 + batch : 1 + batch + contracted]
  outer = stack.shape[1 + batch + contracted :]
  K, N, b = math.prod(inner), math.prod(outer), spec.block

  def one(w):  # [in..., out...]
    w = w.reshape(K, N)
    forward = _weight(w, spec)  # w.T [N, K] along K
    values = forward.values.T.reshape(*inner, *outer)
    if spec.weight_tile > 1:
      tiles = forward.scales[::b].T  # [K / b, N / b]
      return (values, tiles.reshape(*inner[:-1], -1, *outer[:-1], outer[-1] // b)), forward
    by_n = quantize(w, spec)  # [K, N] along N
    return (
      values,
      forward.scales.T.reshape(*inner[:-1], -1, *outer),
      by_n.values.reshape(*inner, *outer),
      by_n.scales.reshape(*inner, *outer[:-1], outer[-1] // b),
    ), forward

  for _ in range(1 + batch):  # the layer axis, then the batch axes
    one = jax.vmap(one)
  cast, forward = one(jax.lax.stop_gradient(stack))
  return CastWeight(stack, cast, forward.global_scale)


def _cached(w: CastWeight, K: int, N: int, spec: Format) -> tuple[Quantized, Quantized]:
  """The (forward, input-gradient) quantizations of one layer's w [K, N] (flattened) from
  `quantize_weights`' arrays."""
  b = spec.block
  if spec.weight_tile > 1:
    values, tiles = w.cast
    tiles = tiles.reshape(K // b, N // b)
    forward = Quantized(values.reshape(K, N).T, jnp.repeat(tiles.T, b, axis=0), w.scale)
    return forward, transposed(forward, spec)
  values_k, scales_k, values_n, scales_n = w.cast
  forward = Quantized(values_k.reshape(K, N).T, scales_k.reshape(K // b, N).T, w.scale)
  return forward, Quantized(values_n.reshape(K, N), scales_n.reshape(K, N // b), w.scale)


def einsum_for(fmt: str):
  """The einsum a weight matmul runs in `fmt`: block-scaled, or jnp.einsum for "none" (the
  compute dtype; model/mla.py's projections and model/moe.py's experts)."""
  return jnp.einsum if fmt == "none" else functools.partial(einsum, fmt=fmt)


def batch_axes(spec: str) -> str:
  """The batch axes of a weight matmul's spec: in x, w and the output (the expert axis `e`
  of a stack of experts' "becd,edgf->becgf"); "" for a shared weight's."""
  xs, ws, out = dense.split(spec)
  return "".join(a for a in xs if a in ws and a in out)


def einsum(spec: str, x: jax.Array, w: jax.Array | CastWeight, fmt: str) -> jax.Array:
  """jnp.einsum(spec, x, w) with block-scaled GEMMs, for x [tokens..., in...] and
  w [in..., out...] (every weight matmul of the block), or with batch axes in x, w and
  the output, leading in w (a stack of experts, w [e, in..., out...]: one GEMM an expert);
  w may carry its quantizations (`quantize_weights`, its batch axes leading too). The
  output is named OUTPUT_NAME, or BATCHED_OUTPUT_NAME with batch axes."""
  batch = batch_axes(spec)
  y = _einsum(spec, x, w, fmt, batch)
  return checkpoint_name(y, BATCHED_OUTPUT_NAME if batch else OUTPUT_NAME)


def _einsum(
  spec: str,
  x: jax.Array,
  w: jax.Array | CastWeight,
  fmt: str,
  batch: str,
  row_groups: int = 1,
):
  """row_groups: how many groups x's rows (tokens) come in, each group's rows together,
  when a vmapped axis was moved out from between the groups and the rest (below)."""
  if batch:
    # One GEMM per batch index: the batch axes moved to the front of x and vmapped over
    # (the vmap rule of `_cudnn`'s GEMM makes them the batch axis of cuDNN's).
    xs, ws, out = dense.split(spec)
    if not ws.startswith(batch):
      raise ValueError(f"block-scaled einsum: {spec!r} has batch axes {batch!r} not leading in w")
    drop = lambda axes: "".join(a for a in axes if a not in batch)
    inner = f"{drop(xs)},{drop(ws)}->{drop(out)}"
    # Token axes before the batch axis (a stack of experts' buffer [b, e, c, d], as the
    # dispatch all-to-all leaves it): the fused quantization reads each expert's rows in
    # place, in those groups, rather than after a transpose to [e, b, c, d].
    before = xs[: xs.index(batch[0])]
    groups = 1
    if len(batch) == 1 and not set(before) & set(ws):
      groups = math.prod(x.shape[: len(before)])
    x = jnp.moveaxis(x, [xs.index(a) for a in batch], range(len(batch)))
    run = lambda x, w: _einsum(inner, x, w, fmt, "", groups)
    for _ in batch:
      run = jax.vmap(run)
    y = run(x, w)  # [batch..., rest of out...]
    return jnp.moveaxis(y, range(len(batch)), [out.index(a) for a in batch])
  axes = dense.weight_axes(spec)
  if axes is None:
    raise ValueError(f"block-scaled einsum: {spec!r} is not [tokens, in] x [in, out]")
  tokens, contracted, _ = axes
  weight = w.weight if isinstance(w, CastWeight) else w
  lead = x.shape[: len(tokens)]
  rows, inner = math.prod(lead), math.prod(x.shape[len(tokens) :])
  flat = weight.reshape(inner, -1)  # [K, N]
  cached = _cached(w, *flat.shape, FORMATS[fmt]) if isinstance(w, CastWeight) else None
  y = _matmul(FORMATS[fmt], row_groups, x.reshape(rows, inner), flat, cached)
  return y.reshape(*lead, *weight.shape[len(contracted) :])
