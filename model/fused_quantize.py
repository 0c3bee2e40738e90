"""MXFP8 quantization of an activation (or gradient) both ways in one kernel, for CUDA.

Every block-scaled GEMM operand that is not a weight is quantized twice
(model/block_scaled.py `_forward`, `_backward`): along its last axis K, for the GEMM that
contracts K, and along its rows M, transposed, for the weight-gradient GEMM, which contracts
the tokens. Written in jnp, XLA compiles the pair into an amax reduction and a convert
fusion per direction, which read the bf16 operand three or four times, and the transposed
direction's passes also write a bf16 transpose: about 8 bytes of HBM traffic an element in
512 GB200 DeepSeek-V3's compiled step. Transformer Engine's MXFP8 quantize reads the operand
once and writes both copies ("rowwise" and "columnwise") and their scales; so does this
kernel: 2 bytes read and 2 written an element, plus a scale byte per 32.

It is a Pallas call on the Triton backend, which XLA compiles for the target GPU into one
`__gpu$xla.gpu.triton` custom call (the projection costs it as one kernel whose bytes are its
operand and outputs). Each program quantizes one [bm, bk] tile of one matrix: the tile's
32-value blocks along K (its rows) and along M (its columns), the latter stored transposed.
The scales are written as E8M0 bit patterns (2^(bits - 127)) in uint8, which Triton can
store, and reinterpreted outside.

The scale rule is model/block_scaled.py `quantize`'s: 2^ceil(log2(amax / 448)), 1 for an
all-zero block; the values x / scale, clipped to E4M3's 448. In interpret mode (CPU) the
kernel gives the same bits as `quantize` (tests/test_block_scaled.py). On a GPU, Triton's
log2 and exp2 are approximate: a block whose amax / 448 lies within a rounding error of a
power of two may take the next scale up or down; clipping keeps its values in range.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import triton as pallas_triton
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

BLOCK = 32  # MXFP8: one scale per 32 values (OCP Microscaling spec)
E4M3_MAX = 448.0
# Tile sides: Triton's block dimensions are powers of two; the largest of these dividing
# the (per-device) side is used, a multiple of BLOCK by the callers' check.
_TILE_SIDES = (128, 64, 32)


def _tile(side: int) -> int:
  return next(t for t in _TILE_SIDES if side % t == 0)


def _scale(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(scale as float32, its E8M0 bits as uint8) of each block's amax."""
  exponent = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / E4M3_MAX))
  bits = jnp.where(amax > 0, exponent, 0.0).astype(jnp.int32) + 127
  # 2^exponent made from its bits, exactly: exp2 may be approximate (XLA:CPU's is), and a
  # scale off by an ulp moves values that sit on a rounding tie of E4M3.
  scale = jax.lax.bitcast_convert_type(jax.lax.shift_left(bits, 23), jnp.float32)
  return scale, bits.astype(jnp.uint8)


def _kernel(x_ref, by_k_ref, by_k_bits_ref, by_m_ref, by_m_bits_ref, *, bm: int, bk: int):
  x = x_ref[...].astype(jnp.float32)  # [bm, bk]
  rows = x.reshape(bm, bk // BLOCK, BLOCK)
  scale, bits = _scale(jnp.max(jnp.abs(rows), axis=2))  # [bm, bk / 32]
  values = jnp.clip(rows / scale[:, :, None], -E4M3_MAX, E4M3_MAX)
  by_k_ref[...] = values.reshape(bm, bk).astype(by_k_ref.dtype)
  by_k_bits_ref[...] = bits
  cols = x.reshape(bm // BLOCK, BLOCK, bk)
  scale, bits = _scale(jnp.max(jnp.abs(cols), axis=1))  # [bm / 32, bk]
  values = jnp.clip(cols / scale[:, None, :], -E4M3_MAX, E4M3_MAX)
  by_m_ref[...] = values.reshape(bm, bk).T.astype(by_m_ref.dtype)
  by_m_bits_ref[...] = bits.T


def _call(a: jax.Array, interpret: bool = False) -> tuple[jax.Array, ...]:
  """a [B, M, K] -> (values [B, M, K], scale bits [B, M, K/32], values of a^T [B, K, M],
  scale bits [B, K, M/32])."""
  B, M, K = a.shape
  bm, bk = _tile(M), _tile(K)
  tile = lambda rows, cols, swap: pl.BlockSpec(
    (None, rows, cols), (lambda b, i, j: (b, j, i)) if swap else (lambda b, i, j: (b, i, j))
  )
  out = jax.ShapeDtypeStruct
  quantized = pl.pallas_call(
    functools.partial(_kernel, bm=bm, bk=bk),
    grid=(B, M // bm, K // bk),
    in_specs=[tile(bm, bk, False)],
    out_specs=[
      tile(bm, bk, False),
      tile(bm, bk // BLOCK, False),
      tile(bk, bm, True),
      tile(bk, bm // BLOCK, True),
    ],
    out_shape=[
      out((B, M, K), jnp.float8_e4m3fn),
      out((B, M, K // BLOCK), jnp.uint8),
      out((B, K, M), jnp.float8_e4m3fn),
      out((B, K, M // BLOCK), jnp.uint8),
    ],
    compiler_params=pallas_triton.CompilerParams(),
    interpret=interpret,
  )(a)
  return tuple(quantized)


def _specs(sharding, shape) -> tuple[tuple, tuple]:
  """(input spec, transposed spec) a partitioned call runs with: the input's, less a split
  of M or K that would leave a device a side that is not a multiple of BLOCK."""
  batch, m, k = (*sharding.spec, None, None, None)[:3]
  mesh = sharding.mesh

  def kept(entry, side):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return entry if (side // math.prod(mesh.shape[a] for a in axes)) % BLOCK == 0 else None

  m, k = kept(m, shape[1]), kept(k, shape[2])
  return (batch, m, k), (batch, k, m)


def _infer(interpret, mesh, shapes, result_shape):
  spec, transposed = _specs(shapes[0].sharding, shapes[0].shape)
  named = lambda s: NamedSharding(shapes[0].sharding.mesh, P(*s))
  return (named(spec), named(spec), named(transposed), named(transposed))


def _partition(interpret, mesh, shapes, result_shape):
  spec, transposed = _specs(shapes[0].sharding, shapes[0].shape)
  named = lambda s: NamedSharding(shapes[0].sharding.mesh, P(*s))
  outs = (named(spec), named(spec), named(transposed), named(transposed))
  return mesh, functools.partial(_call, interpret=interpret), outs, (named(spec),)


@functools.partial(custom_partitioning, static_argnums=(1,))
def _partitioned(a: jax.Array, interpret: bool) -> tuple[jax.Array, ...]:
  """`_call` with an SPMD rule: each device quantizes its own [B, M, K] block (a Pallas call
  has none of its own, and would be gathered whole)."""
  return _call(a, interpret)


_partitioned.def_partition(
  infer_sharding_from_operands=_infer,
  partition=_partition,
  sharding_rule="b m k -> b m k, b m k, b k m, b k m",
)


@functools.cache
def _batched(interpret: bool):
  @jax.custom_batching.custom_vmap
  def quantize(a: jax.Array) -> tuple[jax.Array, ...]:
    lead = a.shape[:-2]
    out = _partitioned(a.reshape(-1, *a.shape[-2:]), interpret)  # [prod(lead), ...]
    return tuple(o.reshape(*lead, *o.shape[1:]) for o in out)

  @quantize.def_vmap
  def _vmap(axis_size, in_batched, a):
    # The model's vmaps (replicas, context ranks, stages, experts) lead: one more batch axis.
    return quantize(a), (True,) * 4

  return quantize


def mxfp8_both_ways(a: jax.Array, interpret: bool = False) -> tuple[jax.Array, ...]:
  """a [M, K] (M and K multiples of 32) -> (values [M, K] in E4M3, scales [M, K/32] in
  E8M0, values of a^T [K, M], scales [K, M/32]): a quantized along K, and a^T along M."""
  vk, sk, vm, sm = _batched(interpret)(a)
  e8m0 = lambda bits: jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)
  return vk, e8m0(sk), vm, e8m0(sm)
