"""Pipeline parallelism: micro-batches flow through layer stages laid along `pipeline`.

Layout. The layer stack [L, ...] (logical axis `stage`, rules.py) is split over the P
pipeline ranks in contiguous blocks of L / P rows. Each block holds V virtual stages
(train.virtual_stages) of C = L / (P V) layers: chunk v of rank s is the model's chunk
v P + s, so a micro-batch crosses the ranks V times, 0, 1, ..., P-1, 0, 1, ... (the
interleaved or circular schedule; V = 1 is GPipe). Stored row s V C + v C + j is model
layer (v P + s) C + j; `stage_order` / `model_order` convert.

Uneven split (`split`). When P V does not divide L, the layers may split as the published
Megatron runs split them, with the embedding and the loss counted as pipeline layers:
L + 2 = P V C, the first chunk one layer lighter (the embedding's place) and the last one
too (the loss's). The stack then holds P V C rows, of which the first and the last in
model order are padding: copies of a neighbouring layer that the chunks skip (their output
replaced by their input, so their gradients are zero). Every chunk still runs C layer
slots, as lockstep SPMD ranks do anyway; `active_rows` says which are layers. In general
C = ceil(L / (P V)) and the P V C - L padding rows are split between the two ends (the
first half, rounded down, in front), fewer than C at each end, so that the first and the
last chunk hold a layer: DeepSeek-V3's 58 routed layers in 16 chunks of 4 leave 3 at each
end (NVIDIA's layout puts the embedding and the 3 dense layers in the first chunk, MTP and
the loss in the last).

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
the move is `jnp.roll` along it, which XLA partitions into a collective-permute. `run` is
one data-parallel replica's pipeline; the lockstep gradient strategy vmaps it over the
replicas (parallelism/gradients.py), so that each replica accumulates its own weight
gradients through the backward loop and they are reduced over `data` once, not once per
trip.

parallelism/one_f_one_b.py runs the same layout under the 1F1B schedule, its backward
written out instead of derived from this loop.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from errors import UserInputError
from parallelism import rules

# Name scope of the pipeline loop. In the optimized HLO the forward loop is the while op
# whose op_name ends "jvp(pipeline)/while" and the backward loop the one ending
# "transpose(jvp(pipeline))/while", each with known_trip_count = trips(); one trip as
# documented above.
PIPELINE_SCOPE = "pipeline"
MESH_AXIS = "pipeline"


def trips(micro_batches: int, stages: int, virtual_stages: int) -> int:
  """Trips of the pipeline loop (forward; the backward loop runs as many)."""
  return micro_batches * virtual_stages + stages - 1


def bubble_fraction(micro_batches: int, stages: int, virtual_stages: int) -> float:
  """Share of the loop's trips a rank idles."""
  return (stages - 1) / trips(micro_batches, stages, virtual_stages)


def passes(requested: int, micro_batches: int, stages: int, schedule: str = "gpipe") -> int:
  """Pipeline passes per step: `requested`, or for 0 the most passes that divide the
  micro-batches and hold at least `stages` each (1F1B's activation memory); the 1f1b
  schedule runs one."""
  if schedule == "1f1b":
    return 1
  if requested:
    return requested
  return max(
    n
    for n in range(1, micro_batches + 1)
    if micro_batches % n == 0 and (micro_batches // n >= stages or n == 1)
  )


def check(
  num_layers: int,
  stages: int,
  virtual_stages: int,
  micro_batches: int,
  passes: int = 1,
  schedule: str = "gpipe",
) -> None:
  """Bad pipeline shapes raise UserInputError naming the field."""
  split(num_layers, stages, virtual_stages)
  if schedule == "1f1b" and micro_batches % stages:
    raise UserInputError(
      f"train.pipeline_schedule 1f1b runs micro-batches in groups of mesh.pipeline = "
      f"{stages}; {micro_batches} per data-parallel replica is not a multiple "
      f"(change train.micro_batch or train.global_batch)"
    )
  if micro_batches % passes:
    raise UserInputError(
      f"train.pipeline_passes = {passes} does not divide the "
      f"{micro_batches} micro-batches per data-parallel replica"
    )
  if virtual_stages > 1 and micro_batches // passes < stages:
    raise UserInputError(
      f"train.virtual_stages > 1 needs at least mesh.pipeline = {stages} "
      f"micro-batches per data-parallel replica and pass, got {micro_batches // passes} "
      f"(lower train.micro_batch or train.pipeline_passes)"
    )


def split(num_layers: int, stages: int, virtual_stages: int) -> tuple[int, bool]:
  """(layer slots per chunk C, padded): equal chunks of L / (P V) layers, else C =
  ceil(L / (P V)) slots a chunk with the P V C - L padding slots at the two ends, fewer than
  C at each (`padding`; e.g. the embedding and the loss counted as layers, L + 2 = P V C).
  Neither: UserInputError."""
  chunks = stages * virtual_stages
  if num_layers % chunks == 0:
    return num_layers // chunks, False
  chunk = -(-num_layers // chunks)
  if padding(num_layers, chunks * chunk)[1] < chunk:
    return chunk, True
  raise UserInputError(
    f"model.num_layers = {num_layers} does not split into mesh.pipeline {stages} x "
    f"train.virtual_stages {virtual_stages} = {chunks} chunks: it must be a multiple of "
    f"{chunks}, or leave fewer than C padding slots at each end of {chunks} chunks of C "
    f"(e.g. {chunks} x C - 2 with C >= 2: the embedding and the loss counted as layers)"
  )


def padding(num_layers: int, rows: int) -> tuple[int, int]:
  """Padding rows (in front, at the end) in model order of a stack of `rows` slots."""
  lead = (rows - num_layers) // 2
  return lead, rows - num_layers - lead


def stack_rows(num_layers: int, stages: int, virtual_stages: int) -> int:
  """Rows of the stored layer stack: L, or L + 2 with an uneven split's padding."""
  chunk, _ = split(num_layers, stages, virtual_stages)
  return stages * virtual_stages * chunk


def _position_of_row(rows: int, stages: int, virtual_stages: int) -> np.ndarray:
  """Each stored row's position in model order (padding included)."""
  chunk = rows // (stages * virtual_stages)
  s, rest = np.divmod(np.arange(rows), virtual_stages * chunk)
  v, j = np.divmod(rest, chunk)
  return (v * stages + s) * chunk + j


def active_rows(num_layers: int, stages: int, virtual_stages: int) -> np.ndarray | None:
  """[P, V C] bool, whether each stored row of each rank is a layer; None for an even
  split (every row is)."""
  chunk, padded = split(num_layers, stages, virtual_stages)
  if not padded:
    return None
  rows = stages * virtual_stages * chunk
  position = _position_of_row(rows, stages, virtual_stages)
  lead, trail = padding(num_layers, rows)
  return ((position >= lead) & (position < rows - trail)).reshape(stages, virtual_stages * chunk)


def stage_order(layers: Any, stages: int, virtual_stages: int) -> Any:
  """Layer-stacked arrays (leading axis L) from model order to the stored stage order;
  an uneven split's padding rows copy the layer beside them."""

  def leaf(x):
    chunk, padded = split(x.shape[0], stages, virtual_stages)
    rows = stages * virtual_stages * chunk
    position = _position_of_row(rows, stages, virtual_stages)
    if padded:
      position = np.clip(position - padding(x.shape[0], rows)[0], 0, x.shape[0] - 1)
    return x[position]

  return jax.tree.map(leaf, layers)


def model_order(layers: Any, stages: int, virtual_stages: int, num_layers: int = 0) -> Any:
  """The inverse of `stage_order`: the stored rows (num_layers of them layers; 0: all) in
  model order, padding dropped."""

  def leaf(x):
    order = np.argsort(_position_of_row(x.shape[0], stages, virtual_stages))
    if num_layers and num_layers != x.shape[0]:
      lead, trail = padding(num_layers, x.shape[0])
      order = order[lead : x.shape[0] - trail]
    return x[order]

  return jax.tree.map(leaf, layers)


# The layer row running now (1.0) or a padding row or idle trip whose output is dropped
# (0.0), as a traced float, while `masked_chunk` or `run` runs it; None elsewhere. A
# layer whose backward adds to gradients beyond its output's cotangent (model/moe.py: the
# balance loss's gradient and the experts' loads) scales that part by it, which zero
# output cotangents alone do not silence.
_ROW_WEIGHT: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
  "pipeline_row_weight", default=None
)


def row_weight() -> jax.Array | None:
  """The weight of the padding-masked row being traced (see _ROW_WEIGHT), or None."""
  return _ROW_WEIGHT.get()


@contextlib.contextmanager
def _row(weight: jax.Array) -> Iterator[None]:
  token = _ROW_WEIGHT.set(weight)
  try:
    yield
  finally:
    _ROW_WEIGHT.reset(token)


def masked_chunk(
  run_chunk: Callable[[jax.Array, Any, tuple[jax.Array, int]], jax.Array],
  x: jax.Array,
  params: Any,
  first: jax.Array,
  active: jax.Array,
) -> jax.Array:
  """An uneven split's chunk: its C rows from `first` one at a time, a padding row's output
  replaced by its input. active [C] bool."""
  outer = row_weight()  # an idle trip's (`run`), if any
  for j in range(active.shape[0]):
    weight = active[j].astype(jnp.float32)
    with _row(weight if outer is None else weight * outer):
      x = jnp.where(active[j], run_chunk(x, params, (first + j, 1)), x)
  return x


def pin(x: jax.Array) -> jax.Array:
  """Pin the leading axis to the pipeline ranks, the rest as the partitioner likes."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  spec = PartitionSpec(MESH_AXIS, *(PartitionSpec.UNCONSTRAINED,) * (x.ndim - 1))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def run(
  run_chunk: Callable[[jax.Array, dict, tuple[jax.Array, int]], jax.Array],
  layers: dict[str, jax.Array],
  inputs: jax.Array,
  stages: int,
  virtual_stages: int,
  active: np.ndarray | None = None,
) -> jax.Array:
  """All layers on every micro-batch of one data-parallel replica through the pipeline.

  run_chunk(x, rank_params, (first, C)): the rows first .. first + C - 1 of one rank's
  stack (leading axis V C) on one micro-batch x [b, ...]; it slices the stack itself, inside
  its remat boundary, so that a per-trip slice of the weights is never saved for the
  backward pass.
  layers: stacked [L, ...] in stage order, sharded over `pipeline`. inputs
  [M, b, ...]: the replica's embedded micro-batches. active: `active_rows` of an uneven
  split (None: even). Returns the last layer's outputs [M, b, ...], held by rank 0.
  """
  P, V, M = stages, virtual_stages, inputs.shape[0]
  C = jax.tree.leaves(layers)[0].shape[0] // (P * V)
  # [L, ...] -> [P, V C, ...]: splits the sharded axis along its blocks, no data moves.
  chunks = jax.tree.map(lambda x: x.reshape(P, V * C, *x.shape[1:]), layers)
  rank = jnp.arange(P)

  def one_rank(params, t, s, x, rank_active):
    k = t - s
    v = jnp.clip(k // M, 0, V - 1)
    # An idle trip's result is dropped, but a routed layer's loads and balance-loss
    # gradient do not vanish with its output's cotangent: weighted 0 (model/moe.py).
    with _row(((k >= 0) & (k < M * V)).astype(jnp.float32)):
      if rank_active is None:
        return run_chunk(x, params, (v * C, C))
      row_active = jax.lax.dynamic_slice_in_dim(rank_active, v * C, C)
      return masked_chunk(run_chunk, x, params, v * C, row_active)

  mask = None if active is None else jnp.asarray(active)

  def trip(carry, t):
    x, buffer = carry  # [P, b, ...], [P, M, b, ...]
    y = jax.vmap(one_rank, in_axes=(0, None, 0, 0, 0), spmd_axis_name=MESH_AXIS)(
      chunks, t, rank, x, mask
    )
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
    return (pin(jnp.where(is_first, entering, y)), pin(buffer)), None

  buffer = pin(jnp.broadcast_to(inputs, (P, *inputs.shape)))
  x = pin(buffer[:, 0])
  with rules.vmapped(MESH_AXIS), jax.named_scope(PIPELINE_SCOPE):
    (_, buffer), _ = jax.lax.scan(trip, (x, buffer), jnp.arange(trips(M, P, V)))
  return buffer[0]
