"""The 1F1B pipeline schedule (train.pipeline_schedule "1f1b"; interleaved with V > 1).

pipeline.py runs every forward trip of a pass before its backward trips (autodiff of one
loop), so a pass keeps all its micro-batches' activations and pays the P - 1 fill and
drain trips once per pass. Here each trip runs one forward chunk and one backward chunk
per rank, the backward written out with `jax.vjp` (the residuals of each forward chunk
are kept in slots until its backward), so the fill and drain are paid once a step
(Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters
using Megatron-LM", the interleaved schedule).

Layout as in pipeline.py: rank s holds chunks v = 0 .. V-1 of C layers, model chunk
v P + s. Micro-batches go in groups of P (M must be a multiple of P): forward item
k = g P V + v P + i is chunk v of micro-batch m = g P + i, run by rank s at trip k + s,
so a micro-batch leaving rank P-1 re-enters rank 0 for its next chunk on the next trip.
An uneven split's padding rows (pipeline.py `split`) are skipped inside the chunk, by the
flags `run` slices for it.
Backward item j = g P V + c P + i is chunk V-1-c of micro-batch g P + i (chunks in
reverse), run by rank s at trip j + D + (P-1-s), flowing from rank s to s-1, with

    D = V P + P - 1:

the forward trips of group g's last chunks end on rank P-1 at trip g P V + D - 1, the
loss head runs on the group's P outputs between loops (in a trip it would need a
conditional: trips differ in whether a group ends), and its gradients enter rank P-1's
backward from trip B_g = g P V + D. The loops, all ranks in lockstep, a rank computing on
stale data where the schedule has nothing for it (its gradient zeroed):

    fill    D trips, forward only
    steady  G - 1 times: head of group g, then P V trips, forward and backward
    drain   head of the last group, then P V + P - 1 trips, backward only

Every rank runs M V forward and M V backward chunks in M V + P - 1 trips of each kind:
the bubble is (P - 1) / (M V + P - 1), as one GPipe pass of all M micro-batches, while a
rank keeps at most D + P forward chunks' residuals (a slot read backward is reused from
the next trip): P + (2 P - 1) / V micro-batches' worth of its layers, against about
P + (P - 1) / V in Megatron's schedule, whose head runs inside the pipeline.

With `reduce_specs` (Megatron's distributed optimizer with --overlap-grad-reduce) the
weight gradients are reduce-scattered over `data` (and summed over `context`) while the
drain still computes, not after the step: every chunk's last backward runs in the last
group, so chunk V-1-k is final on every rank after drain trip k P + 2 P - 2 (rank 0 is
last). The drain's last (V - 1) P trips run as a loop of V - 1 iterations of P trips
(DRAIN_REDUCE_SCOPE), iteration k reduce-scattering chunk V-1-k beside its trips'
backward. Chunk 0 is final only after the last trip: it is reduced after the loop.

With `prepare` (Megatron's --overlap-param-gather) the fill mirrors this: the constants a
chunk reads (block scaling's weight quantizations, each kernel gathered whole over `data`
first) are made chunk by chunk, not all before the first trip. Rank s first runs chunk v
at trip v P + s, so the fill's first (V - 1) P trips run as a loop of V - 1 iterations of
P trips (FILL_GATHER_SCOPE), iteration v preparing chunk v + 1 beside its trips' forward.
Chunk 0 is prepared before the loop, where nothing runs beside it.

The backward is jax.vjp's: a forward chunk's vjp is a pytree whose leaves are its
residuals (what the remat policy saves, the chunk input among them); they go into the
slots, except the leaves that are the chunk's weights themselves, which are sliced again.
"""

import dataclasses
import functools
import heapq
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from parallelism import rules
from parallelism.pipeline import MESH_AXIS, pin

# Name scopes of the three loops; the projection finds them by their while ops' op_name.
FILL_SCOPE = "pipeline_fill"
STEADY_SCOPE = "pipeline_steady"
DRAIN_SCOPE = "pipeline_drain"
# The drain's last (V - 1) P trips when they reduce gradients (`reduce_specs`).
DRAIN_REDUCE_SCOPE = "pipeline_drain_reduce"
# The fill's first (V - 1) P trips when they prepare the constants (`prepare`).
FILL_GATHER_SCOPE = "pipeline_fill_gather"

# Columns of the schedule table, one row per trip and rank.
(
  F_CHUNK,
  F_FROM_INPUT,
  F_MICRO,
  F_SLOT,
  F_OUT,
  B_VALID,
  B_CHUNK,
  B_SLOT,
  B_FROM_HEAD,
  B_HEAD_ROW,
  B_OUT,
) = range(11)


class _Carry(NamedTuple):
  """What the loops carry; every field per rank, leading axis P."""

  x: jax.Array  # the input of this trip's forward chunk [P, b, ...]
  g: jax.Array  # the output gradient of this trip's backward chunk [P, b, ...]
  slots: list  # forward residuals, each [P, slots + 1, ...]
  grads: Any  # (weight gradients, the largest amaxes observed: scales' cotangents), [P, V C, ...]
  outs: jax.Array  # the current group's last-layer outputs [P, P + 1, b, ...] (rank P-1's)
  dys: jax.Array  # their loss gradients [P, P, b, ...] (for rank P-1)
  d_inputs: jax.Array  # input gradients by micro-batch [P, M + 1, b, ...] (rank 0's)
  # In the drain's reducing loop (`reduce_specs`), else None: {weight: the rows of the
  # final chunk its next iteration reduce-scatters}, and {weight: the gradient summed over
  # `data` and `context`, this replica's block of the scatter dimension [P, V C, ...]}
  parts: Any = None
  reduced: Any = None


@dataclasses.dataclass(frozen=True)
class Schedule:
  micro_batches: int
  stages: int
  virtual_stages: int
  table: np.ndarray  # [trips, P, 11] int32, the columns above
  slots: int  # residual slots per rank; slot `slots` takes idle trips' writes

  @property
  def delay(self) -> int:
    return self.virtual_stages * self.stages + self.stages - 1

  @property
  def groups(self) -> int:
    return self.micro_batches // self.stages

  @property
  def group_trips(self) -> int:
    return self.stages * self.virtual_stages

  @property
  def drain_trips(self) -> int:
    return self.group_trips + self.stages - 1

  @property
  def reducing_trips(self) -> int:
    """The drain's last trips, which reduce the final chunks' gradients: a loop
    (DRAIN_REDUCE_SCOPE) of `reducing_iterations`, `stages` trips each."""
    return self.reducing_iterations * self.stages

  @property
  def reducing_iterations(self) -> int:
    return self.virtual_stages - 1

  @property
  def gathering_trips(self) -> int:
    """The fill's first trips, which prepare the next chunk's constants: a loop
    (FILL_GATHER_SCOPE) of `gathering_iterations`, `stages` trips each."""
    return self.gathering_iterations * self.stages

  @property
  def gathering_iterations(self) -> int:
    return self.virtual_stages - 1


@functools.lru_cache(maxsize=32)
def schedule(micro_batches: int, stages: int, virtual_stages: int) -> Schedule:
  M, P, V = micro_batches, stages, virtual_stages
  D = V * P + P - 1
  total = M * V + D + P - 1
  table = np.zeros((total, P, 11), np.int32)
  table[:, :, F_OUT] = P  # the head buffer's spare row
  table[:, :, B_OUT] = M  # the input-gradient buffer's spare row
  # Each rank takes its lowest free slot; a slot read backward is free from the next trip.
  slot_of, free, used = {}, [list(range(M * V)) for _ in range(P)], 0
  for t in range(total):
    released = []
    for s in range(P):
      row = table[t, s]
      j = t - D - (P - 1 - s)
      if 0 <= j < M * V:
        g, r = divmod(j, P * V)
        c, i = divmod(r, P)
        v, m = V - 1 - c, g * P + i
        row[B_VALID], row[B_CHUNK], row[B_HEAD_ROW] = 1, v, i
        row[B_SLOT] = slot_of.pop((s, v, m))
        row[B_FROM_HEAD] = s == P - 1 and v == V - 1
        if s == 0 and v == 0:
          row[B_OUT] = m
        released.append((s, row[B_SLOT]))
      k = t - s
      row[F_SLOT] = -1
      if 0 <= k < M * V:
        g, r = divmod(k, P * V)
        v, i = divmod(r, P)
        m = g * P + i
        row[F_CHUNK], row[F_MICRO] = v, m
        row[F_FROM_INPUT] = s == 0 and v == 0
        row[F_SLOT] = slot_of[(s, v, m)] = heapq.heappop(free[s])
        used = max(used, row[F_SLOT] + 1)
        if s == P - 1 and v == V - 1:
          row[F_OUT] = i
    for s, slot in released:
      heapq.heappush(free[s], slot)
  table[:, :, F_SLOT] = np.where(table[:, :, F_SLOT] < 0, used, table[:, :, F_SLOT])
  return Schedule(M, P, V, table, used)


def _from_last_rank(slots: jax.Array, activation_axes: Sequence[str | None]) -> jax.Array:
  """slots [P (rank), P, b, ...] -> [P (rank), b, ...]: rank i gets rank P-1's slot i, in
  one all-to-all over `pipeline`, each rank moving its own shard of the activations
  (their logical axes: activation_axes). Left to the partitioner (rank P-1's buffer
  indexed, then split over the ranks), it was broadcast by an all-to-all and two rounds
  of collective-permutes: 512 H100 as published, 20 ms for each of 8 groups."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return slots[-1]
  spec = PartitionSpec(MESH_AXIS, None, *rules.spec(activation_axes))
  manual = (
    {MESH_AXIS}
    | rules.vmapped_axes()
    | {a for name in activation_axes if name for a in rules.mesh_axes_of(name)}
  )

  def local(own):  # own [1, P, ...]: this rank's shard of its slots
    # Slot i of every rank to rank i: [P (source rank), ...], of which rank P-1's is kept.
    return jax.lax.all_to_all(own[0], MESH_AXIS, 0, 0, tiled=True)[-1:]

  out_spec = PartitionSpec(MESH_AXIS, *spec[2:])
  return jax.shard_map(
    local, mesh=mesh, in_specs=spec, out_specs=out_spec, axis_names=manual, check_vma=False
  )(slots)


def _past_replicas(make: Callable[[int], Callable], offset: int = 0) -> Callable:
  """make(offset)(*arrays, first): arrays with `offset` leading axes before their
  [P, V C, ...], read or written at rows first .. by scalar-index dynamic (update-)slices,
  which XLA runs in place. jax.vmap turns those into a gather and a scatter, whose bounds
  check XLA keeps as a separate copy of the rows: mapped over arrays with the index
  unmapped (the data and context replicas' vmaps), the mapped axis becomes one more
  leading axis instead. A mapped index is vmapped plainly: correct, not in place."""
  fn = jax.custom_batching.custom_vmap(make(offset))

  @fn.def_vmap
  def _(axis_size, in_batched, *args):
    arrays = [
      a if mapped else jnp.broadcast_to(a, (axis_size, *a.shape))
      for a, mapped in zip(args[:-1], in_batched[:-1])
    ]
    if in_batched[-1]:
      return jax.vmap(make(offset))(*arrays, args[-1]), True
    return _past_replicas(make, offset + 1)(*arrays, args[-1]), True

  return fn


def _rows_at(ndim: int, offset: int, first) -> list:
  # [replicas' vmaps..., P, V C, ...]: the rows are the axis after the rank's.
  start = [0] * ndim
  start[offset + 1] = first
  return start


def _adder(offset: int) -> Callable:
  """total, part, first -> total with part added to its rows first .. (`_rows_at`): a
  dynamic slice, an add and a dynamic-update-slice, fused into one in-place kernel."""

  def add(total, part, first):
    start = _rows_at(total.ndim, offset, first)
    rows = jax.lax.dynamic_slice(total, start, part.shape) + part
    return jax.lax.dynamic_update_slice(total, rows, start)

  return add


def _add_rows(totals: Any, parts: Any, first: jax.Array) -> Any:
  """Each rank's weight gradients [P, V C, ...] with its chunk's [P, C, ...] added to rows
  first .. first + C - 1 (first [P]), the gradients of every weight (pytrees alike).

  Per rank, in a shard_map manual over `pipeline`, where its row index is a scalar
  (`_past_replicas`). Under the ranks' vmap the index is mapped, and XLA writes the sum of
  the rows and the part to a temporary that a second kernel copies into the stack, as it
  does for the stack plus a zero-padded part (Llama 3.1 405B at 8,192 H100 as published:
  2 x 872 MB more a trip, 0.3 s a step)."""
  add = _past_replicas(_adder)

  def local(totals, parts, first):  # this rank's: [1, V C, ...], [1, C, ...], [1]
    return jax.tree.map(lambda total, part: add(total, part, first[0]), totals, parts)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    added = jax.vmap(local)(*jax.tree.map(lambda a: a[:, None], (totals, parts, first)))
    return jax.tree.map(lambda a: a[:, 0], added)
  rank = PartitionSpec(MESH_AXIS)
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(rank, rank, rank),
    out_specs=rank,
    axis_names={MESH_AXIS} | rules.vmapped_axes(),
    check_vma=False,
  )(totals, parts, first)


DATA, CONTEXT = "data", "context"


def _entry_axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _without_data(spec: PartitionSpec) -> PartitionSpec:
  def entry(e):
    axes = tuple(a for a in _entry_axes(e) if a != DATA)
    return None if not axes else axes[0] if len(axes) == 1 else axes

  return PartitionSpec(*(entry(e) for e in spec))


def scatter_dim(spec: PartitionSpec) -> int | None:
  """The dimension of a stacked weight [L, ...] that `data` splits in the layout `spec` of
  its reduced gradient (`data` last in its axes: sharding.over_data), where the drain can
  reduce its gradient; None where the step reduces it after the pipeline (`data` splits
  no dimension past the stack's, or the stack is not split over `pipeline`)."""
  with_data = [d for d, e in enumerate(spec) if DATA in _entry_axes(e)]
  if len(with_data) != 1 or with_data[0] == 0 or not spec or spec[0] != MESH_AXIS:
    return None
  return with_data[0]


def _taker(rows: int) -> Callable[[int], Callable]:
  """grad, first -> rows first .. first + rows - 1 of one device's gradient [P, V C, ...]."""

  def make(offset):
    def take(grad, first):
      size = list(grad.shape)
      size[offset + 1] = rows
      return jax.lax.dynamic_slice(grad, _rows_at(grad.ndim, offset, first), size)

    return take

  return make


def _scatterer(scatter: int, context: bool) -> Callable[[int], Callable]:
  """part, reduced, first -> reduced with the rows `part` (`_taker`'s) reduce-scattered over
  `data` along dimension `scatter` of [P, V C, ...] (and summed over `context`) in place."""

  def make(offset):
    def reduce(part, reduced, first):
      summed = jax.lax.psum_scatter(
        rules.on_wire(part), DATA, scatter_dimension=offset + scatter, tiled=True
      )
      if context:
        summed = jax.lax.psum(summed, CONTEXT)
      start = _rows_at(reduced.ndim, offset, first)
      return jax.lax.dynamic_update_slice(reduced, summed.astype(reduced.dtype), start)

    return reduce

  return make


def _on_blocks(local: Callable, specs: dict, arrays: tuple[dict, ...], first) -> dict:
  """local(*arrays, first) on each device's blocks: a shard_map manual over every mesh
  axis, each dict of arrays [P, V C, ...] laid out by the [L, ...] specs less `data`."""
  mesh = jax.sharding.get_abstract_mesh()
  names = sorted(arrays[0])
  # [L, ...] -> [P, V C, ...]: the stack's dimension splits into ranks and rows.
  spec = {n: PartitionSpec(MESH_AXIS, None, *_without_data(specs[n])[1:]) for n in names}
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(*(spec for _ in arrays), PartitionSpec()),
    out_specs=spec,
    axis_names=frozenset(mesh.axis_names),
    check_vma=False,
  )(*({n: a[n] for n in names} for a in arrays), first)


def _take_rows(grads: dict, dims: dict, specs: dict, first, rows: int) -> dict:
  """{weight: rows first .. first + rows - 1 of its gradient [P, V C, ...]}, for the weights
  of `dims`."""
  take = _past_replicas(_taker(rows))
  return _on_blocks(
    lambda g, first: {n: take(a, first) for n, a in g.items()},
    specs,
    ({n: grads[n] for n in dims},),
    first,
  )


def _scatter_rows(parts: dict, reduced: dict, dims: dict, specs: dict, first) -> dict:
  """`reduced` with each weight's rows `parts` (`_take_rows`) reduce-scattered into place."""
  mesh = jax.sharding.get_abstract_mesh()
  context = mesh.shape.get(CONTEXT, 1) > 1
  # The rows cross as rules.on_wire says (float32 on CPU meshes).
  scatter = {n: _past_replicas(_scatterer(dims[n] + 1, context)) for n in parts}
  return _on_blocks(
    lambda p, r, first: {n: scatter[n](p[n], r[n], first) for n in p},
    specs,
    (parts, reduced),
    first,
  )


def join_reduced(shards: jax.Array, spec: PartitionSpec, replica_axes: Sequence[str]) -> jax.Array:
  """The replicas' blocks of a weight gradient the drain reduced, [R, (CP,) L, ...] with
  the scatter dimension 1/R of the weight's, -> the gradient [L, ...] laid out as `spec`,
  without moving a byte: each device keeps its own block (replica r's is block r of its
  scatter dimension; the context ranks hold the same sums)."""
  mesh = jax.sharding.get_abstract_mesh()
  inner = _without_data(spec)
  in_spec = PartitionSpec(
    *replica_axes, *inner, *(None,) * (shards.ndim - len(replica_axes) - len(inner))
  )
  return jax.shard_map(
    lambda a: a[(0,) * len(replica_axes)],
    mesh=mesh,
    in_specs=in_spec,
    out_specs=spec,
    axis_names=frozenset(mesh.axis_names),
    check_vma=False,
  )(shards)


def run(
  chunk_fn: Callable[[jax.Array, Any, Any, Any], jax.Array],
  weights: Any,
  scales: Any,
  constants: Any,
  inputs: jax.Array,
  head: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, Any]],
  stages: int,
  virtual_stages: int,
  activation_axes: Sequence[str | None],
  active: np.ndarray | None = None,
  zero_idle_grads: bool = False,
  reduce_specs: dict[str, PartitionSpec] | None = None,
  prepare: Callable[[Any], Any] | None = None,
  stored_specs: dict[str, PartitionSpec] | None = None,
) -> tuple[jax.Array, Any, Any, jax.Array, Any]:
  """One data-parallel replica's forward and backward through the pipeline.

  chunk_fn(x, chunk_weights, chunk_scales, chunk_constants): C layers (the rows of a
  rank's stack that make up one chunk) on one micro-batch x [b, ...]. weights: the
  stacked layer parameters to differentiate, [L, ...] in stage order, sharded over
  `pipeline`; scales: stacked values whose cotangents are observations to keep the
  largest of, not to sum (FP8 delayed scaling's scales, whose cotangents are amaxes);
  constants: stacked arrays the chunks read but are not differentiated for (FP8 weight
  casts). inputs [P, M, b, ...]: the embedded micro-batches, each rank's own copy (rank 0
  reads them). head(ys, g): on group g's last-layer outputs ys [P, b, ...], its loss, the
  loss's gradient for ys and any gradients of its own, per rank ([P, ...] each: summed
  over the ranks once, after the loops, not in every group). activation_axes: the logical
  axes of a micro-batch's activations [b, ...]. active: an uneven split's `pipeline.active_rows`
  [P, V C] (None: even); chunk_fn then takes a fifth argument, the chunk's rows' [C] flags.
  zero_idle_grads: an idle trip's weight gradient is dropped, for layers whose backward adds
  to it beyond what their zeroed output cotangent gives (model/moe.py's loads and balance
  loss); otherwise it is zero anyway and nothing is selected.

  reduce_specs: {weight name: the layout of its reduced gradient [L, ...], with a
  `scatter_dim`} (weights a dict, V > 1): those weights are reduced in the drain (module
  docstring)
  when V > 1, and their gradients come back summed over the replicas of `data` and
  `context`, as this replica's block of the scatter dimension (`join_reduced` puts the
  blocks together).

  prepare(rows): the constants of the weights' rows [C, ...] (one chunk of one rank), made
  in the fill chunk by chunk (module docstring) rather than passed as `constants`, which
  must then be empty; it reads the weights of stored_specs: {name: its layout as stored,
  [L, ...]}.

  Returns (summed head losses, gradients of weights [L, ...], the largest cotangent of
  each scale over the micro-batches [L, ...], gradients of inputs [P, M, b, ...] (zero but
  on rank 0), summed head gradients).
  """
  P, V, M = stages, virtual_stages, inputs.shape[1]
  plan = schedule(M, P, V)
  C = jax.tree.leaves(weights)[0].shape[0] // (P * V)
  # [L, ...] -> [P, V C, ...]: splits the sharded axis along its blocks, no data moves.
  by_rank = lambda tree: jax.tree.map(lambda x: x.reshape(P, V * C, *x.shape[1:]), tree)
  # The chunks differentiate (weights, scales) together; their cotangents accumulate
  # apart, summed and maximised.
  rank_weights, rank_constants = by_rank((weights, scales)), by_rank(constants)
  if prepare is not None and jax.tree.leaves(constants):
    raise ValueError("one_f_one_b.run: constants are prepared or passed, not both")
  structure = {}  # of the forward's vjp: its tree, and for each leaf a shared leaf or None

  def chunk_rows(tree, first):
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, first, C), tree)

  def forward(x, w, consts, first, rank_active):
    # The chunk's rows are sliced outside the vjp, so the weight gradient has C rows, not
    # the whole stack; a residual that is one of those rows is sliced again backward
    # rather than kept.
    w, consts = chunk_rows(w, first), chunk_rows(consts, first)
    if rank_active is None:
      y, vjp = jax.vjp(lambda x, w: chunk_fn(x, *w, consts), x, w)
    else:
      flags = jax.lax.dynamic_slice_in_dim(rank_active, first, C)
      y, vjp = jax.vjp(lambda x, w: chunk_fn(x, *w, consts, flags), x, w)
    leaves, treedef = jax.tree.flatten(vjp)
    shared = jax.tree.leaves((w, consts))
    if "vjp" not in structure:
      index = {id(leaf): n for n, leaf in enumerate(shared)}
      structure["vjp"] = treedef, tuple(index.get(id(leaf)) for leaf in leaves)
    _, sources = structure["vjp"]
    if len(leaves) != len(sources) or any(
      n is not None and leaf is not shared[n] for leaf, n in zip(leaves, sources)
    ):
      raise RuntimeError("a pipeline chunk's residuals differ between traces")
    return y, [leaf for leaf, n in zip(leaves, sources) if n is None]

  def backward(kept, w, consts, first, g):
    """(input gradient, the chunk's weight gradient [C, ...])."""
    treedef, sources = structure["vjp"]
    shared, kept = jax.tree.leaves((chunk_rows(w, first), chunk_rows(consts, first))), iter(kept)
    leaves = [next(kept) if n is None else shared[n] for n in sources]
    return jax.tree.unflatten(treedef, leaves)(g)

  def max_rows(total, part, first):  # [V C] scalars a row: small enough to slice
    rows = jnp.maximum(jax.lax.dynamic_slice_in_dim(total, first, C), part)
    return jax.lax.dynamic_update_slice_in_dim(total, rows, first, 0)

  def rank_trip(w, consts, inputs, row, carry, rank_active, do_forward, do_backward):
    """(the carry on, the chunk's weight gradient [C, ...] and its first row, or None): the
    gradient is added to its rows outside the vmap (`_add_rows`)."""
    y, dx = carry.x, carry.g  # what an idle direction passes on
    added = None
    slots, grads, outs, d_inputs = carry.slots, carry.grads, carry.outs, carry.d_inputs
    if do_forward:
      entering = jnp.where(row[F_FROM_INPUT] == 1, inputs[row[F_MICRO]], carry.x)
      y, kept = forward(entering, w, consts, row[F_CHUNK] * C, rank_active)
      slots = [
        jax.lax.dynamic_update_index_in_dim(s, a, row[F_SLOT], 0) for s, a in zip(slots, kept)
      ]
      outs = jax.lax.dynamic_update_index_in_dim(outs, y, row[F_OUT], 0)
    if do_backward:
      # An idle trip's gradient is zero, so its weight gradient adds nothing.
      g = jnp.where(row[B_FROM_HEAD] == 1, carry.dys[row[B_HEAD_ROW]], carry.g)
      g = g * row[B_VALID].astype(g.dtype)
      kept = [s[row[B_SLOT]] for s in slots]
      first = row[B_CHUNK] * C
      dx, (dw, d_scales) = backward(kept, w, consts, first, g)
      if zero_idle_grads:
        dw = jax.tree.map(lambda a: jnp.where(row[B_VALID] == 1, a, 0), dw)
      # An idle trip recomputes its forward on stale data: its observations are dropped.
      d_scales = jax.tree.map(lambda a: jnp.where(row[B_VALID] == 1, a, 0), d_scales)
      grads = (grads[0], jax.tree.map(lambda t, part: max_rows(t, part, first), grads[1], d_scales))
      added = dw, first
      d_inputs = jax.lax.dynamic_update_index_in_dim(d_inputs, dx, row[B_OUT], 0)
    return _Carry(y, dx, slots, grads, outs, carry.dys, d_inputs), added

  def trip(carry, consts, row, do_forward, do_backward):  # row [P, 11]
    done, added = jax.vmap(
      functools.partial(rank_trip, do_forward=do_forward, do_backward=do_backward),
      spmd_axis_name=MESH_AXIS,
    )(rank_weights, consts, inputs, row, carry._replace(parts=None, reduced=None), mask)
    done = done._replace(parts=carry.parts, reduced=carry.reduced)
    if added is not None:
      done = done._replace(grads=(_add_rows(done.grads[0], *added), done.grads[1]))
    # Forward outputs move one rank on, gradients one rank back.
    moved = done._replace(x=jnp.roll(done.x, 1, 0), g=jnp.roll(done.g, -1, 0))
    return jax.tree.map(pin, moved)

  def loop(carry, consts, rows, do_forward, do_backward):
    run_trip = lambda c, row: (trip(c, consts, row, do_forward, do_backward), None)
    return jax.lax.scan(run_trip, carry, rows)[0]

  def reducing_loop(carry, consts, rows):
    """The drain's last (V - 1) P trips, P an iteration: iteration k reduce-scatters chunk
    V - 1 - k's gradients (its rows taken at the end of the iteration before, so that the
    collective waits for none of the iteration's backward) while its P trips compute, and
    takes chunk V - 2 - k's, final after its last trip. One collective a chunk: a
    collective's latency grows with the replicas (a ring's steps), so pieces of a chunk
    a trip cost more than they hide."""
    blocks = rows.reshape(V - 1, P, *rows.shape[1:])
    chunks = V - 1 - np.arange(V - 1)

    def iteration(carry, xs):
      block, first = xs
      reduced = _scatter_rows(carry.parts, carry.reduced, dims, specs, first)
      for i in range(P):
        carry = trip(carry, consts, block[i], False, True)
      parts = _take_rows(carry.grads[0], dims, specs, first - C, C)
      return carry._replace(reduced=reduced, parts=parts), None

    return jax.lax.scan(iteration, carry, (blocks, jnp.asarray(chunks * C)))[0]

  def stored_rows(name, first):
    """Rows first .. first + C - 1 of every rank's stack of weight `name` [P, C, ...], as
    stored: each device slices its own block. (Left to the partitioner, the whole stack
    was gathered over `data` and then sliced: Llama 3.1 405B at 512 GB300, every chunk's
    kernels in each iteration.)"""
    rows = jax.lax.dynamic_slice_in_dim(rank_weights[0][name], first, C, 1)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return rows
    # [L, ...] -> [P, C, ...] (the stack's dimension split into ranks and rows, as by_rank).
    spec = PartitionSpec(MESH_AXIS, None, *stored_specs[name][1:])
    return jax.lax.with_sharding_constraint(rows, jax.sharding.NamedSharding(mesh, spec))

  def prepared(first):
    """The constants of rows first .. first + C - 1 of every rank's stack [P, C, ...]."""
    rows = {name: stored_rows(name, first) for name in stored_specs}
    return jax.vmap(prepare, spmd_axis_name=MESH_AXIS)(rows)

  def place(buffer, rows, first):  # rows [P, C, ...] into buffer [P, V C, ...]
    update = lambda b, r: jax.lax.dynamic_update_slice_in_dim(b, r, first, 1)
    return jax.tree.map(update, buffer, rows)

  def gathering_loop(carry, buffer, pending, rows):
    """The fill's first (V - 1) P trips, P an iteration: iteration v places chunk v's
    constants `pending` (prepared in the iteration before, so that its trips wait for
    nothing but their placing) and prepares chunk v + 1's while its P trips compute.
    Returns the carry on, and the buffer once chunk V - 1's constants are placed too."""
    blocks = rows.reshape(V - 1, P, *rows.shape[1:])

    def iteration(state, xs):
      carry, buffer, pending = state
      block, first = xs
      buffer = place(buffer, pending, first)
      pending = prepared(first + C)
      for i in range(P):
        carry = trip(carry, buffer, block[i], True, False)
      return (carry, buffer, pending), None

    firsts = jnp.asarray(np.arange(V - 1) * C)
    carry, buffer, pending = jax.lax.scan(iteration, (carry, buffer, pending), (blocks, firsts))[0]
    return carry, place(buffer, pending, (V - 1) * C)

  def run_head(carry, loss, head_grads, group):
    # Spread over the ranks: micro-batch i of the group on rank i.
    ys = _from_last_rank(carry.outs[:, :P], activation_axes)
    group_loss, dys, group_grads = head(ys, group)
    dys = pin(jnp.broadcast_to(dys, (P, *dys.shape)))  # rank P-1 reads them
    return (
      carry._replace(dys=dys),
      loss + group_loss,
      jax.tree.map(jnp.add, head_grads, group_grads),
    )

  mask = None if active is None else jnp.asarray(active)
  per_rank = lambda a: pin(jnp.zeros((P, *a.shape), a.dtype))
  sample = inputs[0, 0]
  gathering = prepare is not None and V > 1
  if prepare is not None:
    with rules.vmapped(MESH_AXIS):
      pending = prepared(jnp.zeros((), jnp.int32))  # chunk 0's, before the fill
    # [P, C, ...] -> [P, V C, ...]: every chunk's rows, laid out as the prepared rows are
    # (zeros would leave the buffer's layout to the partitioner); chunk 0's in place.
    rank_constants = jax.tree.map(lambda a: jnp.concatenate([a] * V, axis=1), pending)
  with rules.vmapped(MESH_AXIS):
    # The forward traced once for the residuals' shapes (and the vjp's structure).
    kept_shapes = jax.eval_shape(
      lambda x, first: jax.vmap(
        lambda x, w, c, a: forward(x, w, c, first, a)[1], spmd_axis_name=MESH_AXIS
      )(x, rank_weights, rank_constants, mask),
      jnp.zeros((P, *sample.shape), sample.dtype),
      jnp.zeros((), jnp.int32),
    )
  slots = [pin(jnp.zeros((P, plan.slots + 1, *a.shape[1:]), a.dtype)) for a in kept_shapes]
  specs = reduce_specs or {}
  dims = {n: scatter_dim(spec) for n, spec in specs.items()}

  def reduced_zeros(n):  # [P, V C, ...], the scatter dimension split over the replicas
    shape = list(rank_weights[0][n].shape)
    shape[dims[n] + 1] //= jax.sharding.get_abstract_mesh().shape[DATA]
    return pin(jnp.zeros(shape, rank_weights[0][n].dtype))

  carry = _Carry(
    x=per_rank(sample),
    g=per_rank(sample),
    slots=slots,
    grads=jax.tree.map(lambda a: pin(jnp.zeros_like(a)), rank_weights),
    outs=per_rank(jnp.zeros((P + 1, *sample.shape), sample.dtype)),
    dys=per_rank(jnp.zeros((P, *sample.shape), sample.dtype)),
    d_inputs=per_rank(jnp.zeros((M + 1, *sample.shape), sample.dtype)),
  )
  rows = jnp.asarray(plan.table)
  D, G, steady = plan.delay, plan.groups, plan.group_trips
  head_shapes = jax.eval_shape(head, jnp.zeros((P, *sample.shape), sample.dtype), 0)
  loss = jnp.zeros((), jnp.float32)
  head_grads = jax.tree.map(lambda a: pin(jnp.zeros(a.shape, a.dtype)), head_shapes[2])
  fill_first = plan.gathering_trips if gathering else 0
  with rules.vmapped(MESH_AXIS):
    if gathering:
      with jax.named_scope(FILL_GATHER_SCOPE):
        carry, rank_constants = gathering_loop(carry, rank_constants, pending, rows[:fill_first])
    with jax.named_scope(FILL_SCOPE):
      carry = loop(carry, rank_constants, rows[fill_first:D], True, False)

    def group_step(state, group_rows):
      carry, loss, head_grads, group = state
      carry, loss, head_grads = run_head(carry, loss, head_grads, group)
      with jax.named_scope(STEADY_SCOPE):
        carry = loop(carry, rank_constants, group_rows, True, True)
      return (carry, loss, head_grads, group + 1), None

    if G > 1:
      state = (carry, loss, head_grads, jnp.zeros((), jnp.int32))
      group_rows = rows[D : D + (G - 1) * steady].reshape(G - 1, steady, *rows.shape[1:])
      (carry, loss, head_grads, _), _ = jax.lax.scan(group_step, state, group_rows)
    carry, loss, head_grads = run_head(carry, loss, head_grads, G - 1)
    drain = rows[D + (G - 1) * steady :]
    plain_trips = plan.drain_trips - (plan.reducing_trips if dims else 0)
    with jax.named_scope(DRAIN_SCOPE):
      carry = loop(carry, rank_constants, drain[:plain_trips], False, True)
    if dims:
      # Chunk V - 1 is final now, chunk 0 only after the last trip. The reduced gradients'
      # buffers (1 / R of the stack's) exist from here on only: carried through every
      # loop, they would add to the memory the slots' residuals peak in.
      parts = _take_rows(carry.grads[0], dims, specs, jnp.asarray((V - 1) * C), C)
      reduced = {n: reduced_zeros(n) for n in dims}
      with jax.named_scope(DRAIN_REDUCE_SCOPE):
        carry = reducing_loop(
          carry._replace(parts=parts, reduced=reduced), rank_constants, drain[plain_trips:]
        )
      zero = jnp.zeros((), jnp.int32)
      reduced = _scatter_rows(carry.parts, carry.reduced, dims, specs, zero)
      carry = carry._replace(reduced=reduced, parts=None)
  unstack = lambda x: x.reshape(P * V * C, *x.shape[2:])
  d_weights, d_scales = jax.tree.map(unstack, carry.grads)
  if dims:
    d_weights = {**d_weights, **{n: unstack(a) for n, a in carry.reduced.items()}}

  # Summed in their own dtype, one reduction over `pipeline` a step (jnp.sum would
  # convert bfloat16 to float32 first and move twice the bytes).
  ranks_sum = lambda a: jax.lax.reduce(a, jnp.zeros((), a.dtype), jax.lax.add, (0,))
  head_grads = jax.tree.map(ranks_sum, head_grads)
  return loss, d_weights, d_scales, carry.d_inputs[:, :M], head_grads
