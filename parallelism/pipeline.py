"""Pipeline parallelism: micro-batches flow through layer stages laid along `pipeline`.

Layout. The layer stack [L, ...] (logical axis `stage`, rules.py) is split over the P
pipeline ranks in contiguous blocks of L / P rows. Each block holds V virtual stages
(train.virtual_stages) of C = L / (P V) layers: chunk v of rank s is the model's chunk
v P + s, so a micro-batch crosses the ranks V times, 0, 1, ..., P-1, 0, 1, ... (the
interleaved or circular schedule; V = 1 is GPipe). Stored row s V C + v C + j is model
layer (v P + s) C + j; `stage_order` / `model_order` convert.

Schedule. The loop runs the stages in lockstep. One trip: every rank applies one chunk
(C layers) to its current micro-batch, then the outputs move one rank on (a collective
permute; the last rank's output returns to rank 0). At trip t rank s works on
k = t - s, that is micro-batch k mod M of chunk k div M, when 0 <= k < M V, and idles
(computes on stale data whose result is dropped) otherwise. So there are

    trips = M V + P - 1,  each rank busy M V of them: bubble = (P - 1) / (M V + P - 1)

of the loop, in the forward loop and in its transpose alike (both run under the name
scope PIPELINE_SCOPE, the `while` ops' op_name says so). A micro-batch leaving rank P-1
after chunk v re-enters rank 0 for chunk v + 1 at trip (v + 1) M + m, M - P + 1 trips
after it left; rank 0 keeps it meanwhile in a per-micro-batch buffer, which also holds
the embedded inputs at the start and the last chunk's outputs at the end. Re-entering
later than it left needs M >= P micro-batches when V > 1.

Everything is one SPMD program: the per-rank state is a [P, ...] array sharded over
`pipeline`, the ranks' work is `jax.vmap` over it with `spmd_axis_name="pipeline"`, and
the move is `jnp.roll` along it, which XLA partitions into a collective-permute. The
whole loop is in turn vmapped over the data-parallel replicas (spmd_axis_name `data`),
each on its own broadcast copy of the weights, so that their gradients are reduced over
`data` once after the backward loop rather than once per trip.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from errors import UserInputError
from parallelism import rules

# Name scope of the pipeline loop. In the optimized HLO the forward loop is the while op
# whose op_name ends "jvp(vmap(pipeline))/while" and the backward loop the one ending
# "transpose(jvp(vmap(pipeline)))/while" (the vmap is over data-parallel replicas), each
# with known_trip_count = trips(); one trip as documented above.
PIPELINE_SCOPE = "pipeline"
MESH_AXIS = "pipeline"
DATA_AXIS = "data"


def trips(micro_batches: int, stages: int, virtual_stages: int) -> int:
  """Trips of the pipeline loop (forward; the backward loop runs as many)."""
  return micro_batches * virtual_stages + stages - 1


def bubble_fraction(micro_batches: int, stages: int, virtual_stages: int) -> float:
  """Share of the loop's trips a rank idles."""
  return (stages - 1) / trips(micro_batches, stages, virtual_stages)


def check(num_layers: int, stages: int, virtual_stages: int, micro_batches: int) -> None:
  """Bad pipeline shapes raise UserInputError naming the field."""
  if num_layers % (stages * virtual_stages):
    raise UserInputError(
      f"model.num_layers = {num_layers} does not split into mesh.pipeline "
      f"{stages} x train.virtual_stages {virtual_stages} equal chunks"
    )
  if virtual_stages > 1 and micro_batches < stages:
    raise UserInputError(
      f"train.virtual_stages > 1 needs at least mesh.pipeline = {stages} "
      f"micro-batches per data-parallel replica, got {micro_batches} "
      f"(lower train.micro_batch)"
    )


def _model_layer_of_row(num_layers: int, stages: int, virtual_stages: int) -> np.ndarray:
  chunk = num_layers // (stages * virtual_stages)
  rows = np.arange(num_layers)
  s, rest = np.divmod(rows, virtual_stages * chunk)
  v, j = np.divmod(rest, chunk)
  return (v * stages + s) * chunk + j


def stage_order(layers: Any, stages: int, virtual_stages: int) -> Any:
  """Layer-stacked arrays (leading axis L) from model order to the stored stage order."""

  def leaf(x):
    return x[_model_layer_of_row(x.shape[0], stages, virtual_stages)]

  return jax.tree.map(leaf, layers)


def model_order(layers: Any, stages: int, virtual_stages: int) -> Any:
  """The inverse of `stage_order`."""

  def leaf(x):
    return x[np.argsort(_model_layer_of_row(x.shape[0], stages, virtual_stages))]

  return jax.tree.map(leaf, layers)


def _mesh_size(axis: str) -> int:
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else mesh.shape.get(axis, 1)


def _pin(x: jax.Array, *leading: str) -> jax.Array:
  """Pin the leading axes to mesh axes (default: the pipeline ranks), the rest as the
  partitioner likes."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  leading = leading or (MESH_AXIS,)
  spec = PartitionSpec(*leading, *(PartitionSpec.UNCONSTRAINED,) * (x.ndim - len(leading)))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def run(
  run_chunk: Callable[[jax.Array, dict, tuple[jax.Array, int]], jax.Array],
  layers: dict[str, jax.Array],
  inputs: jax.Array,
  stages: int,
  virtual_stages: int,
) -> jax.Array:
  """All layers on every micro-batch through the pipeline.

  run_chunk(x, rank_params, (first, C)): the rows first .. first + C - 1 of one rank's
  stack (leading axis V C) on one micro-batch x [b, ...]; it slices the stack itself, inside
  its remat boundary, so that a per-trip slice of the weights is never saved for the
  backward pass.
  layers: stacked [L, ...] in stage order, sharded over `pipeline`. inputs
  [M, b, ...]: the embedded micro-batches. Returns the last layer's outputs [M, b, ...],
  held by rank 0.
  """
  P, V, M = stages, virtual_stages, inputs.shape[0]
  C = jax.tree.leaves(layers)[0].shape[0] // (P * V)
  # [L, ...] -> [P, V C, ...]: splits the sharded axis along its blocks, no data moves.
  chunks = jax.tree.map(lambda x: x.reshape(P, V * C, *x.shape[1:]), layers)
  rank = jnp.arange(P)

  def one_rank(params, t, s, x):
    k = t - s
    v = jnp.clip(k // M, 0, V - 1)
    return run_chunk(x, params, (v * C, C))

  def one_replica(chunks, inputs):
    def trip(carry, t):
      x, buffer = carry  # [P, b, ...], [P, M, b, ...]
      y = jax.vmap(one_rank, in_axes=(0, None, 0, 0), spmd_axis_name=MESH_AXIS)(chunks, t, rank, x)
      y = jnp.roll(y, 1, axis=0)  # rank s's output to rank s + 1
      # Rank 0 now holds what rank P-1 finished at this trip: keep it for its next chunk
      # (or as the final output). Before rank P-1's first micro-batch it holds nothing.
      done, ready = (t - (P - 1)) % M, t >= P - 1

      def keep(buf, received):
        # Read the slot entering next before writing, so that no read needs the buffer's
        # old version and XLA updates it in place (with M = P the two slots coincide).
        following = (t + 1) % M
        entering = jnp.where(ready & (following == done), received, buf[following])
        slot = jnp.where(ready, received, buf[done])
        return jax.lax.dynamic_update_index_in_dim(buf, slot, done, 0), entering

      buffer, entering = jax.vmap(keep, spmd_axis_name=MESH_AXIS)(buffer, y)
      is_first = (rank == 0).reshape(P, *(1,) * (y.ndim - 1))
      return (_pin(jnp.where(is_first, entering, y)), _pin(buffer)), None

    buffer = _pin(jnp.broadcast_to(inputs, (P, *inputs.shape)))
    x = _pin(buffer[:, 0])
    with jax.named_scope(PIPELINE_SCOPE):
      (_, buffer), _ = jax.lax.scan(trip, (x, buffer), jnp.arange(trips(M, P, V)))
    return buffer[0]

  # Each data-parallel replica runs the loop on its own copy of the weights (a broadcast
  # along `data`, no data moves), so the backward loop accumulates each replica's weight
  # gradients locally, and the broadcast's transpose - one reduction over `data` - runs
  # once after the loop instead of once per trip.
  R = _mesh_size(DATA_AXIS)
  split = lambda x: jnp.moveaxis(x.reshape(M, R, -1, *x.shape[2:]), 1, 0)  # [R, M, b/R, ...]
  replicas = jax.tree.map(lambda x: _pin(jnp.broadcast_to(x, (R, *x.shape)), DATA_AXIS), chunks)
  with rules.vmapped(DATA_AXIS, MESH_AXIS):
    out = jax.vmap(one_replica, spmd_axis_name=DATA_AXIS)(replicas, _pin(split(inputs), DATA_AXIS))
  return jnp.moveaxis(out, 0, 1).reshape(inputs.shape)
