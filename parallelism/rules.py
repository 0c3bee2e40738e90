"""Logical axis names -> mesh axes, kept as data.

The model names every parameter and activation dimension with a logical axis; these
rules decide which mesh axes shard it. Changing a parallelism strategy means changing
this table, not the model.
"""

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

RULES: tuple[tuple[str, MeshAxes], ...] = (
  # Parameters.
  ("vocab", "tensor"),  # embedding rows / logits columns: Megatron's vocab-parallel split
  ("embed", "fsdp"),  # ZeRO-3 style: every weight is split over fsdp along d_model
  ("heads", "tensor"),  # attention heads split across tensor-parallel ranks
  # Grouped-query attention's key/value heads: split like the query heads where there
  # are at least as many as tensor ranks, replicated otherwise (SPLIT_WHERE_ENOUGH).
  ("kv_heads", "tensor"),
  ("mlp", "tensor"),  # the 4x hidden width split across tensor-parallel ranks
  ("kv", None),  # head size: never split
  ("qkv", None),  # the q/k/v selector (k/v with grouped-query attention)
  ("gate_up", None),  # SwiGLU's gate / up selector
  ("position", None),  # learned position rows
  ("layers", None),  # the scanned layer stack
  ("stage", "pipeline"),  # the same stack when pipelined: contiguous blocks per stage
  # LoRA adapters' rank (model/lora.py): never split; their other axes are their kernel's.
  ("lora_rank", None),
  ("expert", "expert"),  # routed experts split over expert-parallel ranks (model/moe.py)
  ("expert_mlp", "tensor"),  # an expert's hidden width, tensor parallel like the MLP's
  # model.experts_over_tensor: whole experts split over both, tensor-major, so that a
  # tensor rank's experts are one contiguous share (`tensor_share`) of them.
  ("expert_by_tensor", ("tensor", "expert")),
  # Activations.
  # Expert-parallel ranks are data-parallel outside the routed experts.
  ("batch", ("data", "fsdp", "expert")),
  # Inside the routed experts: the capacity buffer [B, E, C, D] split over experts, its
  # sequences over the other data-parallel axes (the all-to-all moves `expert` between them).
  ("expert_batch", ("data", "fsdp")),
  ("act_expert", "expert"),
  ("act_expert_by_tensor", ("tensor", "expert")),
  # One entry per tensor rank: the share of the experts whose slots that rank dispatches
  # and combines (model.experts_over_tensor).
  ("tensor_share", "tensor"),
  # The sequence inside tensor-parallel regions: split over `context` only (context
  # parallelism, parallelism/context.py; each rank's tokens in load-balanced order).
  ("length", "context"),
  # The sequence of the residual stream with sequence parallelism (model.sequence_parallel):
  # LayerNorm, biases and residual adds run on 1/tensor of the tokens, and the
  # tensor-parallel regions begin with an all-gather and end with a reduce-scatter.
  # Context-major: a context rank's tokens are split over its tensor group, so the
  # gathers over `tensor` rebuild that rank's `length` shard.
  ("act_seq", ("context", "tensor")),
  ("act_embed", None),
  ("act_heads", "tensor"),
  ("act_kv_heads", "tensor"),
  ("act_mlp", "tensor"),
  ("act_vocab", "tensor"),
)

# Logical axes split only where the dimension has at least as many entries as the ranks of
# its mesh axes, and replicated over them otherwise: GQA's K/V heads with more tensor ranks
# than K/V heads (Megatron-Core replicates them likewise). Every rank then holds every
# K/V head, and the partitioner sums the replicated kernel's gradient over the ranks, as
# for any replicated parameter.
SPLIT_WHERE_ENOUGH = frozenset({"kv_heads", "act_kv_heads"})

_RULES = dict(RULES)
_VMAPPED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
  "vmapped", default=frozenset()
)


def spec(logical_axes: Sequence[str | None]) -> PartitionSpec:
  """PartitionSpec for a tuple of logical axis names."""

  def part(name):
    axes = mesh_axes_of(name) if name else ()
    return None if not axes else axes[0] if len(axes) == 1 else axes

  return PartitionSpec(*(part(name) for name in logical_axes))


def mesh_axes_of(logical_axis: str) -> tuple[str, ...]:
  """Mesh axes that shard one logical axis (empty: replicated)."""
  axes = _RULES[logical_axis]
  if axes is None:
    return ()
  axes = (axes,) if isinstance(axes, str) else axes
  return tuple(a for a in axes if a not in _VMAPPED.get())


def resolve(
  logical_axes: Sequence[str | None], shape: Sequence[int], mesh_shape: Mapping[str, int]
) -> tuple[str | None, ...]:
  """logical_axes of an array of `shape`, each SPLIT_WHERE_ENOUGH axis with fewer entries
  than the ranks of its mesh axes (mesh_shape: axis -> size) replaced by None."""

  def keep(name, size):
    if name not in SPLIT_WHERE_ENOUGH:
      return True
    return size >= math.prod(mesh_shape[a] for a in mesh_axes_of(name))

  return tuple(
    name if name is None or keep(name, size) else None for name, size in zip(logical_axes, shape)
  )


@contextlib.contextmanager
def vmapped(*mesh_axes: str) -> Iterator[None]:
  """The rules without `mesh_axes` while tracing code that jax.vmap maps over them
  (spmd_axis_name puts each on the mapped dimension, and a mesh axis cannot shard two
  dimensions of one array)."""
  token = _VMAPPED.set(_VMAPPED.get() | frozenset(mesh_axes))
  try:
    yield
  finally:
    _VMAPPED.reset(token)


def vmapped_axes() -> frozenset[str]:
  return _VMAPPED.get()


def ranks(mesh_axis: str) -> int:
  """`mesh_axis` ranks of the current mesh (1 outside a mesh or without the axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty or mesh_axis not in mesh.shape else mesh.shape[mesh_axis]


def on_wire(x: jax.Array) -> jax.Array:
  """x as a reduce-scatter (or an all-gather, whose transpose is one) carries it on the
  current mesh: float32 on CPU meshes, where XLA:CPU (jax 0.10.2) aborts compiling
  bfloat16 reduce-scatters ("Invalid binary instruction opcode copy"); unchanged on GPU
  targets, which keep the compute dtype."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  return x.astype(jnp.float32) if device is not None and device.platform == "cpu" else x


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Pin an activation's sharding inside jit; a no-op outside a mesh context and inside a
  shard_map manual over every axis (nothing is left to partition there)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
    return x
  axes = resolve(logical_axes, x.shape, mesh.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(axes)))
