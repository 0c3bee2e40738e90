"""Sequence parallelism's collectives at the boundaries of a tensor-parallel region.

With model.sequence_parallel the residual stream is split along the sequence over
`tensor` (rules.py `act_seq`). A region's entry (QKV, fc1) needs every token: an
all-gather along the sequence. Its exit (the attention output projection, fc2) holds
partial sums over `tensor` that must be summed and split along the sequence: a
reduce-scatter. Together they move the bytes of the one all-reduce they replace, and
LayerNorm, biases and residual adds between regions run on 1/tensor of the tokens.

The sharding constraints alone leave each exit an all-reduce and a slice in XLA's CPU
pipeline (the GPU pipeline has a pass that fuses the two), so the collectives are
written out here with all_gather / psum_scatter inside a shard_map that is manual over
`tensor` and automatic over the other axes. Each is the other's transpose, so the
backward pass gets the mirror image. Each collective is nested in a shard_map manual over
the axes that split the batch as well (`_on_own_shards`): left automatic there, the
partitioner gathered every data-parallel replica's tokens around it. An FP8 matmul runs
its region's collectives itself (`Tensor`, model/fp8.py): an entry gathers its input's
E4M3 cast and an exit's backward pass its output gradient's E5M2 cast, half the bytes of
gathering bfloat16 (Transformer Engine gathers both in FP8).
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from errors import UserInputError
from parallelism import rules

TENSOR = "tensor"
CONTEXT = "context"
SEQUENCE = "act_seq"


class Tensor(NamedTuple):
  """The tensor-parallel group, for a matmul that runs its own collectives over it."""

  # A rank's amax -> the amax over every rank of the shard_map (tensor, and context when
  # it is manual): for a shard's cast when the shards are gathered, with one scale.
  amax: Callable[[jax.Array], jax.Array]
  # A rank's amax -> the amax over the context ranks only (the identity without them):
  # they hold the other tokens of the same features, as data-parallel replicas do, and
  # outside the shard_map the partitioner would reduce over them. Tensor ranks holding
  # other features keep their own (model/fp8.py current scaling).
  context_amax: Callable[[jax.Array], jax.Array]
  # Whether the matmul's input is a sequence shard (a region's entry: QKV, fc1) or its
  # output is one (an exit: the attention output projection, fc2).
  entry: bool
  exit: bool
  # A shard [b, T/t, ...] (or [T/t, b, ...]) -> the whole [b, T, ...] along the sequence,
  # and its transpose, partial sums [b, T, ...] -> this rank's shard of their sum over the
  # group.
  gather: Callable[[jax.Array], jax.Array]
  scatter: Callable[[jax.Array], jax.Array]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _per_rank(scale: jax.Array, ranks: int) -> jax.Array:
  """A scale [] -> one copy per rank of the shard_map's manual axes [ranks]. The ranks'
  cotangents are amaxes observed (FP8 delayed scaling, model/fp8.py), combined by their
  max. Passed as a replicated input instead, shard_map's transpose would sum them over
  each manual axis that does not split it (`context`, where every rank saw other tokens)."""
  return jnp.broadcast_to(scale, (ranks,))


_per_rank.defvjp(
  lambda scale, ranks: (_per_rank(scale, ranks), None),
  lambda ranks, _, cotangents: (jnp.max(cotangents),),
)


def _manual_only(logical_axes: Sequence[str | None], manual: frozenset[str]) -> PartitionSpec:
  """The spec of logical_axes over the shard_map's own axes (tensor, and context when the
  sequence is split over it: `act_seq` is context-major, parallelism/context.py)."""

  def part(name):
    axes = tuple(a for a in (rules.mesh_axes_of(name) if name else ()) if a in manual)
    return None if not axes else axes[0] if len(axes) == 1 else axes

  return PartitionSpec(*(part(a) for a in logical_axes))


def _on_own_shards(
  collective: Callable[[jax.Array], jax.Array],
  x: jax.Array,
  logical_axes: Sequence[str | None],
  automatic: frozenset[str],
) -> Callable[[jax.Array], jax.Array]:
  """`collective` (over `tensor`, along the sequence) on each rank's own shard of the
  dimensions that axes in `automatic` split: x's batch over `data` and the like.

  In a shard_map manual over `tensor` only, the partitioner does not carry a sharding
  through a collective: it gives the collective's operand no split over the automatic
  axes, so the batch was all-gathered over `data` before every gather and reduce-scatter
  (each replica then ran the region on every replica's tokens, and sliced its own back
  out). Nesting the collective in a shard_map that is manual over those axes too keeps
  each replica on its own tokens. Only activations pass through it (no weight whose
  gradient the transpose would sum over them), and every spec names every axis it makes
  manual, so its transpose adds no collective."""
  mesh = jax.sharding.get_abstract_mesh()
  if rules.vmapped_axes():
    # Under a jax.vmap with spmd_axis_name (context slabs, pipeline stages, replicas),
    # jax 0.10.2 adds the vmapped axis to a nested shard_map's specs although the outer
    # one already made it manual (a zero-sized shard). There `data` is vmapped too
    # (parallelism/gradients.py _over_replicas), so only `fsdp` / `expert` stay automatic.
    return collective
  if mesh.shape.get("expert", 1) > 1:
    # With `expert` ranks, XLA's SPMD partitioner (jax 0.10.2) fails a check on the
    # nested shard_map (spmd_partitioner.cc ReshardNoCache, a manual subgroup resharded
    # to a sharding that is not; tests/test_moe.py): the gather stays there.
    return collective

  def part(name, size):
    axes = [a for a in (rules.mesh_axes_of(name) if name else ()) if a in automatic]
    axes = [a for a in axes if mesh.shape[a] > 1]
    # An uneven split is left to the partitioner (a shard_map needs even shards).
    if not axes or size % math.prod(mesh.shape[a] for a in axes):
      return None
    return axes[0] if len(axes) == 1 else tuple(axes)

  spec = PartitionSpec(*(part(name, size) for name, size in zip(logical_axes, x.shape)))
  own = frozenset(a for p in spec if p for a in ((p,) if isinstance(p, str) else p))
  if not own:
    return collective
  return jax.shard_map(
    collective, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=own, check_vma=False
  )


def matmul(
  fn: Callable,
  spec: str,
  x: jax.Array,
  w: Any,
  x_axes: Sequence[str | None],
  w_axes: Sequence[str | None],
  out_axes: Sequence[str | None],
  tensor_in_fn: bool = False,
  whole_mesh: bool = False,
) -> jax.Array:
  """fn(spec, x, w) at a tensor-parallel region's boundary, the sequence on axis 1 (or 0,
  where the region runs sequence-major: model/gpt.py `_sequence_major`).

  Entry (x_axes names `act_seq`): x is all-gathered along the sequence first. Exit
  (out_axes names `act_seq`): the partial sums are reduce-scattered along it. With
  tensor_in_fn fn runs both itself, given the group as `tensor=Tensor(...)`
  (model/fp8.py moves its FP8 casts and reduces its amaxes over the group). Outside a
  mesh: the plain fn.

  whole_mesh: fn runs with every mesh axis manual (model/block_scaled.py: jax 0.10.2's
  partitioner of cuDNN's block-scaled matmul fails on partly manual shardings); the axes
  that are neither this region's nor vmapped must then be of size 1.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(spec, x, w)

  # Each collective is the other's transpose: both cross as rules.on_wire says.
  entry, exit_ = SEQUENCE in x_axes[:2], SEQUENCE in out_axes[:2]
  along = tuple(x_axes if entry else out_axes).index(SEQUENCE) if entry or exit_ else 1
  # The logical axes of the tensor split along the sequence: the input at an entry, the
  # output at an exit (a matmul is one or the other); its gradient crosses the other way.
  sharded_axes = x_axes if entry else out_axes

  def all_gather(x):
    def gather(x):
      return jax.lax.all_gather(rules.on_wire(x), TENSOR, axis=along, tiled=True)

    return _on_own_shards(gather, x, sharded_axes, automatic)(x).astype(x.dtype)

  def reduce_scatter(y):
    def scatter(y):
      return jax.lax.psum_scatter(rules.on_wire(y), TENSOR, scatter_dimension=along, tiled=True)

    return _on_own_shards(scatter, y, sharded_axes, automatic)(y).astype(y.dtype)

  # With context parallelism `context` is manual too: its sequence shards are those the
  # gathers over `tensor` complete (left automatic, the partitioner would reshard them).
  context = mesh.shape.get(CONTEXT, 1) > 1
  manual = frozenset({TENSOR} | ({CONTEXT} if context else set()))
  every_rank = (CONTEXT, TENSOR) if context else (TENSOR,)

  def context_amax(a):
    return jax.lax.pmax(a, CONTEXT) if context else a

  # w may carry its FP8 cast and per-tensor scales (model/fp8.py CastWeight): the cast is
  # laid out like w; each scalar is a scale, given to every rank as its own copy.
  scalars = jax.tree.map(lambda leaf: jnp.ndim(leaf) == 0, w)
  # Each scale's copies: one per rank of the manual axes not vmapped (on a context slab,
  # parallelism/context.py, the vmap keeps the copies apart over `context`).
  copies = tuple(a for a in every_rank if a not in rules.vmapped_axes())
  ranks = math.prod(mesh.shape[a] for a in copies)

  def local(x, w):
    w = jax.tree.map(lambda leaf, scalar: leaf[0] if scalar else leaf, w, scalars)
    if tensor_in_fn:
      group = Tensor(
        lambda a: jax.lax.pmax(a, every_rank),
        context_amax,
        entry,
        exit_,
        all_gather,
        reduce_scatter,
      )
      return fn(spec, x, w, tensor=group)
    y = fn(spec, all_gather(x) if entry else x, w)
    return reduce_scatter(y) if exit_ else y

  x_spec, w_spec, out_spec = (_manual_only(a, manual) for a in (x_axes, w_axes, out_axes))
  w = jax.tree.map(lambda leaf, scalar: _per_rank(leaf, ranks) if scalar else leaf, w, scalars)
  w_specs = jax.tree.map(lambda scalar: PartitionSpec(copies) if scalar else w_spec, scalars)
  # Under the pipeline's vmaps (spmd_axis_name `pipeline` and `data`) those axes must be
  # manual here too; elsewhere they stay automatic (an unused manual axis would get
  # no-op all-reduces over one-device groups in the backward pass).
  # check_vma=False: FP8's per-tensor scales mix values that vary over different manual
  # axes (the pipeline's vmap adds one), which the varying-axes check rejects; every
  # collective here is explicit, so the check has nothing else to catch.
  axis_names = manual | rules.vmapped_axes()
  # The axes the partitioner still lays out inside the shard_map (`data` and the others
  # that split the batch), for the collectives to keep (_on_own_shards).
  automatic = frozenset(mesh.axis_names) - axis_names
  if whole_mesh:
    rest = [a for a in mesh.axis_names if a not in axis_names and mesh.shape[a] > 1]
    if rest:
      raise UserInputError(
        f"model.block_scaling with model.sequence_parallel needs mesh axes "
        f"{', '.join(rest)} of size 1 here (this JAX cannot partition cuDNN's "
        "block-scaled matmul over axes left automatic); set model.sequence_parallel=false"
      )
    axis_names = frozenset(mesh.axis_names)
    automatic = frozenset()
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(x_spec, w_specs),
    out_specs=out_spec,
    axis_names=axis_names,
    check_vma=False,
  )(x, w)
