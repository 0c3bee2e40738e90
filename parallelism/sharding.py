"""Shardings for any pytree whose leaves are NNX variables tagged with logical axes.

Optax keeps its moments as copies of the parameter tree, NNX metadata included, so
one function shards parameters and optimizer state alike. Untagged leaves (step
counters) are replicated.
"""

import math
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from errors import UserInputError
from parallelism import rules


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _axes(x: Any) -> tuple | None:
  return x.get_metadata().get("axes") if _is_variable(x) else None


def _resolved_axes(x: Any, mesh: Mesh) -> tuple | None:
  """x's logical axes, those its shape cannot split replicated (rules.SPLIT_WHERE_ENOUGH)."""
  axes = _axes(x)
  return rules.resolve(axes, x.shape, mesh.shape) if axes else axes


def _sharding(x: Any, mesh: Mesh) -> NamedSharding:
  axes = _resolved_axes(x, mesh)
  return NamedSharding(mesh, rules.spec(axes) if axes else PartitionSpec())


def named_shardings(tree: Any, mesh: Mesh) -> Any:
  """A tree of NamedShardings shaped like `tree` (variables keep their wrappers)."""

  def leaf(x):
    sharding = _sharding(x, mesh)
    return x.replace(sharding) if _is_variable(x) else sharding

  return jax.tree.map(leaf, tree, is_leaf=_is_variable)


def bytes_per_device(tree: Any, split_over: str | None = None) -> int:
  """Bytes one device holds of a tree of sharded jax.ShapeDtypeStructs; with `split_over`,
  only of the arrays that mesh axis splits."""
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for x in jax.tree.leaves(tree)
    if split_over is None or split_over in jax.tree.leaves(tuple(x.sharding.spec))
  )


def over_data(tree: Any, mesh: Mesh) -> Any:
  """named_shardings(tree), each array also split over `data` along its largest dimension
  per device that `data` divides: the optimizer state of Megatron's distributed optimizer
  (ZeRO stage 1). The gradients then need only a reduce-scatter over `data`, and the
  updated parameters an all-gather, in place of the all-reduce. An array with no such
  dimension (a scalar) keeps its sharding."""
  ways = mesh.shape["data"]

  def leaf(x):
    sharding = _sharding(x, mesh)
    spec = tuple(sharding.spec) + (None,) * (len(x.shape) - len(sharding.spec))
    axes = [() if p is None else (p,) if isinstance(p, str) else tuple(p) for p in spec]
    per_device = [
      size // math.prod(mesh.shape[a] for a in dim_axes) for size, dim_axes in zip(x.shape, axes)
    ]
    free = [d for d, size in enumerate(per_device) if size % ways == 0]
    if ways > 1 and free:
      dim = max(free, key=lambda d: per_device[d])
      axes[dim] += ("data",)
      sharding = NamedSharding(
        mesh, PartitionSpec(*(a[0] if len(a) == 1 else a or None for a in axes))
      )
    return x.replace(sharding) if _is_variable(x) else sharding

  return jax.tree.map(leaf, tree, is_leaf=_is_variable)


# The configuration field behind each logical parameter axis, for error messages.
_FIELD_OF_AXIS = {
  "heads": "model.num_heads",
  "embed": "model.d_model",
  "kv_heads": "model.num_kv_heads",
  "mlp": "MLP width (model.ffn_dim, or 4 x model.d_model)",
  "vocab": "padded model.vocab_size",
  "kv": "model.head_dim",
  "layers": "model.num_layers",
  "stage": "model.num_layers",
  "position": "model.seq_len",
  "expert": "model.num_experts",
  "expert_by_tensor": "model.num_experts",
  "expert_mlp": "model.moe_ffn_dim",
}


def check_divisible(tree: Any, mesh: Mesh) -> None:
  """Every sharded parameter dimension must split evenly over its mesh axes; one that is
  replicated for want of entries (rules.SPLIT_WHERE_ENOUGH) must divide their ranks
  (each K/V head then serves the query heads of a whole number of ranks)."""

  def check(x):
    for size, name in zip(x.shape, _axes(x) or ()):
      mesh_axes = rules.mesh_axes_of(name) if name else ()
      ways = math.prod(mesh.shape[a] for a in mesh_axes)
      if name in rules.SPLIT_WHERE_ENOUGH and size < ways:
        if ways % size:
          raise UserInputError(
            f"{_FIELD_OF_AXIS.get(name, name)} = {size} over mesh {' x '.join(mesh_axes)} = "
            f"{ways}: the ranks must divide the K/V heads (split) or be a multiple of "
            "them (replicated)"
          )
        continue
      if size % ways:
        raise UserInputError(
          f"{_FIELD_OF_AXIS.get(name, name)} = {size} does not divide over mesh "
          f"{' x '.join(mesh_axes)} = {ways}"
        )

  jax.tree.map(check, tree, is_leaf=_is_variable)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Token batches [B, T]: batch split over every data-parallel axis, each sequence whole
  on every context rank (int32 tokens: each rank takes its load-balanced chunks itself,
  parallelism/context.py, with no collective)."""
  return NamedSharding(mesh, rules.spec(("batch", None)))


def data_parallel_ways(mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in rules.mesh_axes_of("batch"))
