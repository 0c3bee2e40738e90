"""Block-scaled quantization of an activation (or gradient) both ways in one kernel, for CUDA.

Every block-scaled GEMM operand that is not a weight is quantized twice
(model/block_scaled.py `_forward`, `_backward`): along its last axis K, for the GEMM that
contracts K, and along its rows M, transposed, for the weight-gradient GEMM, which contracts
the tokens. Written in jnp, XLA compiles the pair into an amax reduction and a convert
fusion per direction, which read the bf16 operand three or four times, and the transposed
direction's passes also write a bf16 transpose: about 8 bytes of HBM traffic an element in
512 GB200 DeepSeek-V3's compiled step. Transformer Engine's quantize kernels read the
operand once and write both copies ("rowwise" and "columnwise") and their scales; so does
this kernel: 2 bytes read an element, and for MXFP8 2 written (1 for NVFP4's packed 4-bit
values), plus the block scales.

It is a Pallas call on the Triton backend, which XLA compiles for the target GPU into one
`__gpu$xla.gpu.triton` custom call (the projection costs it as one kernel whose bytes are its
operands and outputs). Each program quantizes one [bm, bk] tile of one matrix: the tile's
blocks along K (its rows) and along M (its columns), the latter stored transposed.
- MXFP8: E4M3 values, E8M0 scales written as their bit patterns (2^(bits - 127)) in uint8,
  which Triton can store, and reinterpreted outside.
- NVFP4: E2M1 values packed two a byte (the first in the low nibble, as XLA lays out
  f4e2m1fn), E4M3 scales per 16 values, and the per-tensor scale from the operand's amax,
  taken before the kernel in a reduction of its own (Transformer Engine also takes the
  amax in a kernel before the cast).

The numbers are model/block_scaled.py `quantize`'s, op for op: in interpret mode (CPU) the
kernel gives the same values and scales (tests/test_block_scaled.py). On a GPU, Triton's
log2 is approximate: an MXFP8 block whose amax / 448 lies within a rounding error of a power
of two may take the next scale up or down; clipping keeps its values in range.
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

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Values per block scale (the OCP Microscaling spec for MXFP8; NVIDIA's NVFP4).
BLOCK = {"mxfp8": 32, "nvfp4": 16}
# Tile sides: Triton's block dimensions are powers of two; the largest of these dividing
# the (per-device) side, and at least a block, is used (the callers check that sides are
# multiples of a block).
_TILE_SIDES = (128, 64, 32, 16)
# E2M1's magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 are codes 0-7: a magnitude's code counts the
# midpoints below it, a midpoint itself rounding to the even code (round to nearest even).
_E2M1_UP_FROM = (0.25, 1.25, 2.5, 5.0)  # midpoints that round down: code up only above
_E2M1_UP_AT = (0.75, 1.75, 3.5)  # midpoints that round up


def _tile(side: int, block: int) -> int:
  return next(t for t in _TILE_SIDES if side % t == 0 and t >= block)


def _e8m0(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
  """MXFP8: (scale as float32, its E8M0 bits as uint8) of each block's amax."""
  exponent = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / E4M3_MAX))
  bits = jnp.where(amax > 0, exponent, 0.0).astype(jnp.int32) + 127
  # 2^exponent made from its bits, exactly: exp2 may be approximate (XLA:CPU's is), and a
  # scale off by an ulp moves values that sit on a rounding tie of E4M3.
  scale = jax.lax.bitcast_convert_type(jax.lax.shift_left(bits, 23), jnp.float32)
  return scale, bits.astype(jnp.uint8)


def _e4m3_scale(amax: jax.Array, global_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """NVFP4: (scale as float32, the E4M3 block scale) of each block's amax."""
  stored = (amax / E2M1_MAX / global_scale).astype(jnp.float8_e4m3fn)
  scale = stored.astype(jnp.float32) * global_scale
  return jnp.where(scale > 0, scale, 1.0), stored


def _e2m1_packed(v: jax.Array) -> jax.Array:
  """v [r, c] (|v| <= 6) rounded to E2M1 codes, two a byte along c: [r, c / 2] uint8."""
  magnitude = jnp.abs(v)
  code = jnp.zeros(v.shape, jnp.int32)
  for midpoint in _E2M1_UP_FROM:
    code += (magnitude > midpoint).astype(jnp.int32)
  for midpoint in _E2M1_UP_AT:
    code += (magnitude >= midpoint).astype(jnp.int32)
  code += jnp.where(v < 0, 8, 0)
  r, c = v.shape
  pairs = code.reshape(r, c // 2, 2)
  # The pair's first value in the low nibble: weights 1 and 16.
  weight = 1 + 15 * jax.lax.broadcasted_iota(jnp.int32, pairs.shape, 2)
  return jnp.sum(pairs * weight, axis=2).astype(jnp.uint8)


def _mxfp8_kernel(x_ref, by_k_ref, by_k_scales_ref, by_m_ref, by_m_scales_ref, *, bm, bk):
  x = x_ref[...].astype(jnp.float32)  # [bm, bk]
  b = BLOCK["mxfp8"]
  rows = x.reshape(bm, bk // b, b)
  scale, bits = _e8m0(jnp.max(jnp.abs(rows), axis=2))  # [bm, bk / b]
  values = jnp.clip(rows / scale[:, :, None], -E4M3_MAX, E4M3_MAX)
  by_k_ref[...] = values.reshape(bm, bk).astype(by_k_ref.dtype)
  by_k_scales_ref[...] = bits
  cols = x.reshape(bm // b, b, bk)
  scale, bits = _e8m0(jnp.max(jnp.abs(cols), axis=1))  # [bm / b, bk]
  values = jnp.clip(cols / scale[:, None, :], -E4M3_MAX, E4M3_MAX)
  by_m_ref[...] = values.reshape(bm, bk).T.astype(by_m_ref.dtype)
  by_m_scales_ref[...] = bits.T


def _nvfp4_kernel(gs_ref, x_ref, by_k_ref, by_k_scales_ref, by_m_ref, by_m_scales_ref, *, bm, bk):
  global_scale = jnp.max(gs_ref[...])  # this matrix's per-tensor scale
  x = x_ref[...].astype(jnp.float32)  # [bm, bk]
  b = BLOCK["nvfp4"]
  rows = x.reshape(bm, bk // b, b)
  scale, stored = _e4m3_scale(jnp.max(jnp.abs(rows), axis=2), global_scale)  # [bm, bk / b]
  values = jnp.clip(rows / scale[:, :, None], -E2M1_MAX, E2M1_MAX)
  by_k_ref[...] = _e2m1_packed(values.reshape(bm, bk))
  by_k_scales_ref[...] = stored
  cols = x.reshape(bm // b, b, bk)
  scale, stored = _e4m3_scale(jnp.max(jnp.abs(cols), axis=1), global_scale)  # [bm / b, bk]
  values = jnp.clip(cols / scale[:, None, :], -E2M1_MAX, E2M1_MAX)
  by_m_ref[...] = _e2m1_packed(values.reshape(bm, bk).T)
  by_m_scales_ref[...] = stored.T


def _call(fmt: str, interpret: bool, a: jax.Array, *global_scale) -> tuple[jax.Array, ...]:
  """a [Q1, P, Q2, M, K]: matrices [Q1, Q2] of P x M rows, their row groups P outside Q2 (an
  expert buffer laid out as the dispatch all-to-all leaves it, [sequences, experts, slots,
  D]: read in place, not transposed first), and NVFP4's per-matrix scales [Q1, Q2, 1] ->
  (values [Q1, Q2, P, M, K], scales [.., K / block], values of each matrix transposed
  [Q1, Q2, K, P, M], scales [.., M / block]); NVFP4's values packed two a byte (the last
  axis halved, uint8), MXFP8's scales as E8M0 bits."""
  Q1, P, Q2, M, K = a.shape
  block = BLOCK[fmt]
  bm, bk = _tile(M, block), _tile(K, block)
  per = 2 if fmt == "nvfp4" else 1  # values a stored element

  # One program a tile: grid axis 0 runs over (q1, p, q2), split by lax's div and rem (g is
  # never negative, so they are floor division's): jnp's // and % are jitted functions of
  # several ops each, which Pallas traces into every index map and lowers to Triton in
  # every partitioned call (DeepSeek-V3 671B: about 730 a compile, most of their lowering
  # time).
  def lead(g):
    return jax.lax.div(g, P * Q2), jax.lax.rem(jax.lax.div(g, Q2), P), jax.lax.rem(g, Q2)

  def rows(cols):  # an output tile [bm, cols] of matrix (q1, q2), row group p
    def index(g, i, j):
      q1, p, q2 = lead(g)
      return q1, q2, p, i, j

    return pl.BlockSpec((None, None, None, bm, cols), index)

  def transposed(cols):  # an output tile [bk, cols] of the transposed matrix
    def index(g, i, j):
      q1, p, q2 = lead(g)
      return q1, q2, j, p, i

    return pl.BlockSpec((None, None, bk, None, cols), index)

  values = jnp.uint8 if fmt == "nvfp4" else jnp.float8_e4m3fn
  scales = jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.uint8
  out = jax.ShapeDtypeStruct
  kernel = _nvfp4_kernel if fmt == "nvfp4" else _mxfp8_kernel
  in_specs = [pl.BlockSpec((None, None, None, bm, bk), lambda g, i, j: (*lead(g), i, j))]
  if fmt == "nvfp4":

    def scale_of(g, i, j):  # matrix (q1, q2)'s per-tensor scale
      q1, _, q2 = lead(g)
      return q1, q2, 0

    in_specs.insert(0, pl.BlockSpec((None, None, 1), scale_of))
  quantized = pl.pallas_call(
    functools.partial(kernel, bm=bm, bk=bk),
    grid=(Q1 * P * Q2, M // bm, K // bk),
    in_specs=in_specs,
    out_specs=[rows(bk // per), rows(bk // block), transposed(bm // per), transposed(bm // block)],
    out_shape=[
      out((Q1, Q2, P, M, K // per), values),
      out((Q1, Q2, P, M, K // block), scales),
      out((Q1, Q2, K, P, M // per), values),
      out((Q1, Q2, K, P, M // block), scales),
    ],
    compiler_params=pallas_triton.CompilerParams(),
    interpret=interpret,
  )(*global_scale, a)
  return tuple(quantized)


def _specs(sharding, shape, block: int) -> tuple[tuple, tuple, tuple]:
  """(input, output, transposed output) specs a partitioned call runs with: the input's,
  less a split of M or K that would leave a device a side that is not a multiple of a
  block."""
  q1, p, q2, m, k = (*sharding.spec, *(None,) * 5)[:5]
  mesh = sharding.mesh

  def kept(entry, side):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return entry if (side // math.prod(mesh.shape[a] for a in axes)) % block == 0 else None

  m, k = kept(m, shape[3]), kept(k, shape[4])
  return (q1, p, q2, m, k), (q1, q2, p, m, k), (q1, q2, k, p, m)


def _shardings(fmt, shapes):
  spec, output, transposed = _specs(shapes[0].sharding, shapes[0].shape, BLOCK[fmt])
  named = lambda s: NamedSharding(shapes[0].sharding.mesh, P(*s))
  outs = (named(output), named(output), named(transposed), named(transposed))
  scales = (named((spec[0], spec[2], None)),) if fmt == "nvfp4" else ()
  return outs, (named(spec), *scales)


@functools.cache
def _partitioned(fmt: str, interpret: bool):
  """`_call` with an SPMD rule: each device quantizes its own block (a Pallas call has none
  of its own, and would be gathered whole)."""
  # One jitted function, traced once a shape: otherwise each vmap level around a call and
  # each partitioned call traces the kernel again (DeepSeek-V3 671B's step on 2 cores:
  # lowered in 55 s instead of 85).
  call = jax.jit(functools.partial(_call, fmt, interpret))

  @custom_partitioning
  def quantize(a: jax.Array, *global_scale) -> tuple[jax.Array, ...]:
    return call(a, *global_scale)

  def partition(mesh, shapes, result_shape):
    outs, operands = _shardings(fmt, shapes)
    return mesh, call, outs, operands

  scales = ", a e s" if fmt == "nvfp4" else ""
  quantize.def_partition(
    infer_sharding_from_operands=lambda mesh, shapes, result_shape: _shardings(fmt, shapes)[0],
    partition=partition,
    # Scales and packed values are named by the axes they run along: a block axis splits
    # where its values' axis does.
    sharding_rule=f"a p e m k{scales} -> a e p m k, a e p m k, a e k p m, a e k p m",
  )
  return quantize


@functools.cache
def _batched(fmt: str, interpret: bool, row_groups: int):
  @jax.custom_batching.custom_vmap
  def quantize(a: jax.Array, *global_scale) -> tuple[jax.Array, ...]:
    *lead, R, K = a.shape
    # The innermost batch axis (a stack of experts') lies between the rows' groups and
    # the rest of the rows where the caller moved it out of the buffer: put it back there.
    groups = row_groups if lead and (R // row_groups) % BLOCK[fmt] == 0 else 1
    inner = lead[-1] if groups > 1 else 1
    outer = math.prod(lead) // inner
    five = a.reshape(outer, inner, groups, R // groups, K).swapaxes(1, 2)  # [Q1, P, Q2, M, K]
    scales = (s.reshape(outer, inner, 1) for s in global_scale)
    out = _partitioned(fmt, interpret)(five, *scales)
    return tuple(o.reshape(*lead, R if i < 2 else K, -1) for i, o in enumerate(out))

  @quantize.def_vmap
  def _vmap(axis_size, in_batched, a, *global_scale):
    # The model's vmaps (replicas, context ranks, stages, experts) lead: one more batch axis.
    # NVFP4's per-tensor scale is batched with its operand (each matrix's own).
    assert all(in_batched), in_batched
    return quantize(a, *global_scale), (True,) * 4

  return quantize


def mxfp8_both_ways(
  a: jax.Array, interpret: bool = False, row_groups: int = 1
) -> tuple[jax.Array, ...]:
  """a [M, K] (M and K multiples of 32) -> (values [M, K] in E4M3, scales [M, K/32] in
  E8M0, values of a^T [K, M], scales [K, M/32]): a quantized along K, and a^T along M.
  row_groups: under a vmap, the groups a's rows came in before the vmapped axis was moved
  out from between them (`_batched`)."""
  vk, sk, vm, sm = _batched("mxfp8", interpret, row_groups)(a)
  e8m0 = lambda bits: jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)
  return vk, e8m0(sk), vm, e8m0(sm)


def nvfp4_both_ways(
  a: jax.Array, global_scale: jax.Array, interpret: bool = False, row_groups: int = 1
) -> tuple[jax.Array, ...]:
  """a [M, K] (M and K multiples of 16) with its per-tensor scale (a float32 scalar) ->
  (values [M, K] in E2M1, scales [M, K/16] in E4M3, values of a^T [K, M], scales [K, M/16]);
  row_groups as mxfp8_both_ways'."""
  vk, sk, vm, sm = _batched("nvfp4", interpret, row_groups)(a, global_scale)
  e2m1 = lambda packed: jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn).reshape(
    *packed.shape[:-1], -1
  )
  return e2m1(vk), sk, e2m1(vm), sm
