"""A 1f1b pipelined step composed from compiled pieces, without compiling the whole step.

A pipelined step differs from another of the same model in a few counts: how many trips
its fill, steady and drain loops run (the pipeline depth P, virtual stages V and
micro-batch count M, parallelism/one_f_one_b.py), how many layers a stage holds (its
state, optimizer update and data-parallel collectives) and how many micro-batches
its embedding and head see. What each trip runs, one chunk of `layers_per_chunk` layers
forward and backward with its collective-permutes, is fixed by the tensor / sequence
parallelism, micro-batch, remat and precision.

So `composed` compiles pieces: the real train step at the target's tensor, pipeline and
per-chunk configuration, with P x V' x C layers (C = layers per chunk) and M' micro-batches,
for two or three (V', M') that `piece_shapes` picks, on the reduced mesh (data 2,
projection/layout.py). The target runs the first piece's loops at its own trip counts
(`at_trips`); what runs outside the loops (the update and the data-parallel collectives,
which grow with the layers a stage holds, V C; the embedding and loss head, which grow
with M) and memory are read off the pieces as linear in V and M (`_extrapolate`). Every
part is costed as a whole program is (projection/record.py's costed): cost_model.simulate
with the collectives re-placed on the target cluster (collective_timing), the bubble as
step_loops.bubble_s reads it from that simulation. Memory is linear too: a rank's
residual slots are V P + 2 P - 1 for V >= 2 and two groups or more
(one_f_one_b.schedule), P V for one group.

The pieces' analyses are cached on disk (projection/disk_cache.py:
`$JAX_SCALING_COMPOSE_CACHE`, else a folder beside XLA's kernel cache), keyed by what the
compiled programs depend on: the model with C layers, the train step's fields, the reduced
mesh, the GPU, the jax version and the code that builds and costs them. The data size is not
in the key: a piece's latency profile (aot_compile.latency_profile) is taken on the
reduced mesh itself, and its collectives are re-placed on the target when costed, as in
a full projection.

The full compile (projection/project.py, `how="full"`) stays the reference;
benchmarks/compose_check.py prints the two side by side.
"""

import dataclasses
import os
import re

from errors import UserInputError
from hardware.catalog import Hardware
from parallelism import one_f_one_b
from projection import (
  aot_compile,
  collective_timing,
  cost_model,
  disk_cache,
  hlo,
  layout,
  step_loops,
)
from projection.plan import Target, plan
from projection.record import Compiled, Timing, record, target_memory_gb
from records.points import Composition, ProjectedPoint

# Near HBM capacity XLA's scheduler overlaps less in the whole step than in its pieces,
# and the composition reads low: memory up to 20.9% under the full compile's
# (benchmarks/compose_check.py's random check, docs/validation.md), step time up to 2x
# (GPT-3 175B, H100 512, TP 4 PP 16 VS 6 mb 2 remat none: 16.8 s and 74 GB composed,
# 23.1 s and 84.8 GB whole). So a composed point whose memory is over this share of the
# capacity (1 - 0.209) is compiled whole where `how="auto"` (projection/project.py).
NEAR_CAPACITY = 0.79
# The cached pieces' layout (Piece): a change of it makes new keys.
_FORMAT = 2
CACHE_ENV = "JAX_SCALING_COMPOSE_CACHE"

_FILL, _GATHER, _STEADY, _DRAIN, _REDUCE = (
  re.compile(rf"(^|[/(]){re.escape(scope)}\)*/while$")
  for scope in (
    one_f_one_b.FILL_SCOPE,
    one_f_one_b.FILL_GATHER_SCOPE,
    one_f_one_b.STEADY_SCOPE,
    one_f_one_b.DRAIN_SCOPE,
    one_f_one_b.DRAIN_REDUCE_SCOPE,
  )
)


def piece_shapes(
  virtual_stages: int, groups: int, chunk_loops: bool = False
) -> tuple[tuple[int, int], ...]:
  """(virtual stages, groups of P micro-batches) of the pieces a target of (V, M / P) is
  composed from; the first is the one whose loops the target runs.

  XLA compiles a one-chunk stack (V 1) with its weight slices folded away, and a step of
  one group without the loop over groups (its fill trip scheduled apart); from V 2 and in
  either case a trip of each loop costs the same at any V and count of groups (GPT-3 175B
  on H100: to the microsecond at V 2 and 3, 3 and 4 groups), away from HBM capacity; near
  it XLA's scheduler overlaps less in the whole step, and the composition reads fast
  (docs/validation.md). So the pieces have the target's kind (V 1 or not; one group or
  several): a second with one more virtual stage gives the slope in V, and for several
  groups a third with one more group the slope in M (3 and 4 groups: the two-group
  step's loop over groups runs once, and XLA inlines it). `chunk_loops`: the drain reduces
  gradients (train.overlap_grad_reduce) or the fill gathers kernels
  (train.overlap_param_gather), in a loop of V - 1 iterations that XLA inlines at V 2: the
  pieces start at V 3, both with the loop."""
  first = 1 if virtual_stages == 1 else 3 if chunk_loops else 2
  if groups == 1:
    return ((first, 1), (first + 1, 1))
  return ((first, 3), (first + 1, 3), (first, 4))


@dataclasses.dataclass(frozen=True)
class Piece:
  """One compiled piece's analysis: what the composition reads of it."""

  virtual_stages: int
  micro_batches: int
  program: hlo.Program
  memory_per_device_bytes: int
  data_sharded_state_bytes: int
  compile_target: str
  compile_note: str | None
  compile_s: float


def layers_per_chunk(exp, stages: int) -> int:
  return exp.model.num_layers // (stages * exp.train.virtual_stages)


def composes(exp, reduced: layout.ReducedMesh) -> bool:
  """Whether `exp`'s step on `reduced` is one this module composes: a 1f1b pipeline of
  whole chunks (an uneven split's padded stages are not)."""
  stages = reduced.sizes.get("pipeline", 1)
  return (
    stages > 1
    and exp.train.pipeline_schedule == "1f1b"
    and exp.model.num_layers % (stages * exp.train.virtual_stages) == 0
  )


def _check(exp, reduced: layout.ReducedMesh) -> None:
  stages = reduced.sizes.get("pipeline", 1)
  if stages < 2 or exp.train.pipeline_schedule != "1f1b":
    raise UserInputError(
      "compose: only 1f1b pipelined steps (mesh.pipeline > 1, "
      "train.pipeline_schedule=1f1b) are composed; use --mode=project"
    )
  if exp.model.num_layers % (stages * exp.train.virtual_stages):
    raise UserInputError(
      f"model.num_layers = {exp.model.num_layers} is not a whole number "
      f"of chunks of {stages} stages x {exp.train.virtual_stages} virtual "
      f"stages"
    )


def _piece_exp(exp, stages: int, chunk_layers: int, virtual: int):
  model = dataclasses.replace(exp.model, num_layers=stages * virtual * chunk_layers)
  train = dataclasses.replace(exp.train, virtual_stages=virtual)
  return dataclasses.replace(exp, model=model, train=train)


def _canonical(exp, hw: Hardware, reduced: layout.ReducedMesh) -> layout.ReducedMesh:
  """The reduced mesh as a target of its own (data 2, rounded up to whole nodes): the
  cluster the pieces' latency profile is taken on, whatever the target's data size."""
  block = reduced.devices // reduced.sizes["data"]
  data = reduced.sizes["data"]
  while (block * data) % hw.gpus_per_node:
    data += 1
  mesh = dataclasses.replace(
    exp.mesh,
    data=-1,
    fsdp=reduced.sizes["fsdp"],
    tensor=reduced.sizes["tensor"],
    pipeline=reduced.sizes["pipeline"],
  )
  return plan(dataclasses.replace(exp, mesh=mesh), hw, block * data).reduced


def _key(
  exp,
  hw: Hardware,
  canonical: layout.ReducedMesh,
  chunk_layers: int,
  shapes: tuple[tuple[int, int], ...],
) -> str:
  return disk_cache.key(
    dataclasses.replace(exp.model, num_layers=chunk_layers),
    dataclasses.replace(exp.train, virtual_stages=0, global_batch=0, steps=0),
    exp.latency_profile,
    sorted(canonical.sizes.items()),
    sorted(canonical.target.sizes.items()),
    hw.name,
    hw.gpus_per_node,
    shapes,
    _FORMAT,
  )


def cached_pieces(path: str) -> list[Piece] | None:
  """The pieces cached at `path`, or None when there are none (disk_cache.read)."""
  return disk_cache.read(
    path, lambda c: isinstance(c, list) and c and all(isinstance(p, Piece) for p in c)
  )


def pieces(
  exp, hw: Hardware, reduced: layout.ReducedMesh, shapes: tuple[tuple[int, int], ...]
) -> tuple[list[Piece], bool]:
  """The compiled pieces of `exp` on `reduced` of `shapes` (piece_shapes), and whether they
  came from the disk cache."""
  stages = reduced.sizes["pipeline"]
  chunk_layers = layers_per_chunk(exp, stages)
  canonical = _canonical(exp, hw, reduced)
  if canonical.sizes != reduced.sizes:  # a target whose data axis is below the reduced one's
    canonical = reduced
  folder = disk_cache.folder(CACHE_ENV, "compose")
  path = folder and os.path.join(folder, _key(exp, hw, canonical, chunk_layers, shapes))
  cached = cached_pieces(path) if path else None
  if cached is not None:
    return cached, True
  timer = collective_timing.collective_timer(canonical, hw)
  replicas = reduced.sizes["data"] * reduced.sizes["fsdp"]
  found = []
  for virtual, groups in shapes:
    micro = groups * stages
    piece_exp = _piece_exp(exp, stages, chunk_layers, virtual)
    piece_reduced = dataclasses.replace(
      canonical,
      global_batch=replicas * micro * exp.train.micro_batch,
      micro_batches=micro,
      compiled_micro_batches=micro,
    )
    step, compile_s = aot_compile.compiled_program(piece_exp, hw, piece_reduced, timer)
    found.append(
      Piece(
        virtual,
        micro,
        step.program,
        step.memory_per_device_bytes,
        step.data_sharded_state_bytes,
        step.compile_target,
        step.note,
        compile_s,
      )
    )
  if path:
    disk_cache.write(path, found)
  return found, False


def at_trips(
  program: hlo.Program, micro_batches: int, stages: int, virtual_stages: int
) -> hlo.Program:
  """`program`'s 1f1b loops run as the schedule of (M, P, V) runs them: fill V P + P - 1
  trips (of them the first (V - 1) P in a loop of their own where they gather kernels),
  the loop over groups M / P - 1, each steady loop P V, drain P V + P - 1 (of them the last
  (V - 1) P in a loop of their own where they reduce gradients)."""
  plan = one_f_one_b.schedule(micro_batches, stages, virtual_stages)
  reducing = step_loops.reduces_in_drain(program)
  drain_trips = plan.drain_trips - (plan.reducing_trips if reducing else 0)
  gathering = step_loops.gathers_in_fill(program)
  fill_trips = plan.delay - (plan.gathering_trips if gathering else 0)
  found = {"fill": 0, "groups": 0, "drain": 0}
  entry = []
  for node in program.entry:
    if isinstance(node, hlo.Loop) and _FILL.search(node.op_name):
      node, found["fill"] = dataclasses.replace(node, trip_count=fill_trips), 1
    elif isinstance(node, hlo.Loop) and _GATHER.search(node.op_name):
      node = dataclasses.replace(node, trip_count=plan.gathering_iterations)
    elif isinstance(node, hlo.Loop) and _DRAIN.search(node.op_name):
      node, found["drain"] = dataclasses.replace(node, trip_count=drain_trips), 1
    elif isinstance(node, hlo.Loop) and _REDUCE.search(node.op_name):
      node = dataclasses.replace(node, trip_count=plan.reducing_iterations)
    elif isinstance(node, hlo.Loop) and any(
      isinstance(n, hlo.Loop) and _STEADY.search(n.op_name) for n in node.body
    ):
      body = tuple(
        dataclasses.replace(n, trip_count=plan.group_trips)
        if isinstance(n, hlo.Loop) and _STEADY.search(n.op_name)
        else n
        for n in node.body
      )
      node = dataclasses.replace(node, body=body, trip_count=plan.groups - 1)
      found["groups"] = 1
    entry.append(node)
  # A program of one group has no loop over groups: only a target of one group runs it.
  if found != {"fill": 1, "groups": int(plan.groups > 1 or found["groups"]), "drain": 1}:
    raise RuntimeError(
      f"{program.name}: expected a fill loop, a loop over groups around a "
      f"steady loop ({plan.groups} groups) and a drain loop at the top; "
      f"found {found}"
    )
  return dataclasses.replace(program, entry=tuple(entry))


def _split(program: hlo.Program) -> tuple[hlo.Program, hlo.Program]:
  """(what runs outside the pipeline loops, the loops): costed apart, they add up to the
  step within an async collective that spans a loop (none in the MLPerf step)."""
  loops = tuple(n for n in program.entry if isinstance(n, hlo.Loop))
  rest = tuple(n for n in program.entry if not isinstance(n, hlo.Loop))
  return (dataclasses.replace(program, entry=rest), dataclasses.replace(program, entry=loops))


def _extrapolate(
  values: list[float], shapes: tuple[tuple[int, int], ...], virtual: int, groups: int
) -> float:
  """A quantity of the pieces of `shapes`, linear in V (and in M / P when the pieces
  have several groups), at the target's (virtual, groups)."""
  (v0, g0), (v1, _) = shapes[:2]
  out = values[0] + (virtual - v0) / (v1 - v0) * (values[1] - values[0])
  if len(shapes) > 2:
    g2 = shapes[2][1]
    out += (groups - g0) / (g2 - g0) * (values[2] - values[0])
  return out


def composed(exp, target: Target) -> ProjectedPoint:
  """The projection of `exp` on `target` composed from pieces (`how="composed"`): a
  ProjectedPoint as projection/record.py assembles it, with its `composition` (the
  pieces' shapes, layers per chunk, whether they were cached)."""
  hw, reduced = target.hardware, target.reduced
  _check(exp, reduced)
  target = reduced.target
  stages = target.sizes["pipeline"]
  virtual, micro = exp.train.virtual_stages, reduced.micro_batches
  if micro % stages:
    raise UserInputError(
      f"train: 1f1b needs the {micro} micro-batches a replica to be a "
      f"multiple of the {stages} pipeline stages"
    )
  groups = micro // stages
  # Whether the drain may reduce gradients or the fill gather kernels (train/step.py
  # decides; pieces from V 3 are right either way).
  train = exp.train
  reducing = train.overlap_grad_reduce and train.shard_optimizer and target.sizes["data"] > 1
  gathering = (
    train.overlap_param_gather and train.shard_optimizer and exp.model.block_scaling != "none"
  )
  shapes = piece_shapes(virtual, groups, reducing or gathering)
  found, cached = pieces(exp, hw, reduced, shapes)
  timer = collective_timing.collective_timer(reduced, hw)
  # The target runs the first piece's loops at its own trip counts; what runs outside
  # them (the update, the data-parallel collectives, embedding and head) is read off
  # the pieces as linear in V and M.
  outside = [_split(p.program)[0] for p in found]
  loops = _split(at_trips(found[0].program, micro, stages, virtual))[1]

  def summed(of) -> float:
    return _extrapolate([of(p) for p in outside], shapes, virtual, groups) + of(loops)

  def timing() -> Timing:
    # Each part simulated once; the bubble is read from the loops' simulation.
    fields = len(dataclasses.astuple(cost_model.ZERO))
    trip_s: dict[str, float] = {}
    by_place = {id(p): {} for p in (*outside, loops)}
    simulated = {
      id(p): cost_model.simulate(p.entry, hw, timer, trip_s, by_place[id(p)])
      for p in (*outside, loops)
    }
    costs = {k: dataclasses.astuple(v) for k, v in simulated.items()}
    cost = cost_model.StepCost(*(summed(lambda p, i=i: costs[id(p)][i]) for i in range(fields)))
    by_axis = {
      id(p): collective_timing.exposed_comm_by_axis_s(
        p, hw, reduced, timer, simulated[id(p)].step_s
      )
      for p in (*outside, loops)
    }
    summed_keys = lambda parts: {
      k: summed(lambda p, k=k: parts[id(p)].get(k, 0.0))
      for k in sorted(set().union(*parts.values()))
    }
    return Timing(
      cost,
      step_loops.bubble_s(loops, hw, timer, micro, stages, virtual, trip_s),
      summed_keys(by_axis),
      summed_keys(by_place),
    )

  memory = _extrapolate([p.memory_per_device_bytes for p in found], shapes, virtual, groups)
  split_state = _extrapolate([p.data_sharded_state_bytes for p in found], shapes, virtual, groups)
  compiled = Compiled(
    found[0].compile_target,
    found[0].compile_note,
    0.0 if cached else sum(p.compile_s for p in found),
    summed(hlo.total_flops),
    summed(hlo.dot_flops),
    target_memory_gb(memory, split_state, reduced),
    hlo.uses_fp8(found[0].program),
    hlo.uses_fp4(found[0].program),
    cached,
  )
  composition = Composition([list(s) for s in shapes], layers_per_chunk(exp, stages), cached)
  return record(exp, hw, reduced, compiled, timing, "composed", composition)
