"""Logical axis names -> mesh axes, kept as data.

The model names every parameter and activation dimension with a logical axis; these
rules decide which mesh axes shard it. Changing a parallelism strategy means changing
this table, not the model.
"""

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

RULES: tuple[tuple[str, MeshAxes], ...] = (
    # Parameters.
    ("vocab", "tensor"),      # embedding rows / logits columns: Megatron's vocab-parallel split
    ("embed", "fsdp"),        # ZeRO-3 style: every weight is split over fsdp along d_model
    ("heads", "tensor"),      # attention heads split across tensor-parallel ranks
    ("mlp", "tensor"),        # the 4x hidden width split across tensor-parallel ranks
    ("kv", None),             # head size: never split
    ("qkv", None),            # the q/k/v selector
    ("position", None),       # learned position rows
    ("layers", None),         # the scanned layer stack
    ("stage", "pipeline"),    # the same stack when pipelined: contiguous blocks per stage
    # Activations.
    ("batch", ("data", "fsdp")),
    ("length", None),         # the sequence inside tensor-parallel regions
    # The sequence of the residual stream with sequence parallelism (model.sequence_parallel):
    # LayerNorm, biases and residual adds run on 1/tensor of the tokens, and the
    # tensor-parallel regions begin with an all-gather and end with a reduce-scatter.
    ("act_seq", "tensor"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)

_RULES = dict(RULES)
_VMAPPED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("vmapped", default=frozenset())


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


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Pin an activation's sharding inside jit; a no-op outside a mesh context."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(logical_axes)))
