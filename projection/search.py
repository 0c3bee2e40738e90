"""A search over parallelism configurations: the best few that fit, projected.

For one experiment on N GPUs of one generation:

1. Enumerate every (tensor parallel, expert parallel, context parallel, pipeline
   parallel, virtual stages, micro-batch, remat, pipeline schedule) in the space: tensor
   parallel over the divisors of the NVLink domain (8 on HGX, 72 on NVL72), expert
   parallel for a mixture of experts over the divisors of model.num_experts up to the
   NVLink domain (all of them with mesh.allow_expert_beyond_nvlink; a dense model keeps
   its mesh.expert), context parallel over CONTEXT_PARALLEL for sequences of
   CONTEXT_MIN_SEQ_LEN tokens and more, pipeline and virtual stages over the divisors of
   the pipelined layer count (a mixture of experts' routed layers) and of it + 2 (an
   uneven split, the embedding and the loss counted as layers; virtual stages and
   schedules only with a pipeline), micro-batches over the divisors of the global batch,
   every remat policy, and as schedule 1f1b or the lockstep one (gpipe, interleaved) in
   each of PIPELINE_PASSES passes. Data parallelism takes the rest of the GPUs; fsdp, the
   global batch and everything else stay as the experiment has them.
2. Prune what the shapes cannot take, with the checks a projection itself runs, so a
   candidate that survives would compile: `plan.plan` (the mesh on the cluster, the
   NVLink domain for tensor and for an expert group x context x tensor, the batch over
   the replicas), `moe.check_mesh` (the experts over expert; a mixture of experts
   pipelines under 1f1b only and runs without context parallelism), `pipeline.check`
   (layers over stages, micro-batches per pass for interleaving, in groups of the stages
   for 1f1b; FP8 delayed scaling only under 1f1b), and `train_step.build` on an abstract
   mesh (heads, MLP width and vocabulary over tensor, sequence parallelism). The reason
   recorded is the field the first failing check names. A candidate whose parameters and
   optimizer state alone (exact, from their shardings) exceed the GPU's HBM is pruned too.
3. Order the rest by a cheap analytic prior (`Prior`): first those estimated to fit,
   then by estimated step time.
4. Project candidates in that order (projection/project.py's `project`, as `how` says;
   compiles are cached) until `budget` projections are spent, after a configuration the
   caller includes (a best-configuration sweep: the point's own). The best are the
   fastest projected ones that fit.

The prior only orders; every reported number is a projection.
"""

import collections
import dataclasses
import re
from collections.abc import Callable, Iterator

from jax.sharding import AbstractMesh, AxisType

from errors import UserInputError
from hardware.catalog import Hardware
from model import moe
from model.config import REMAT_POLICIES
from parallelism import gradients, pipeline, sharding
from parallelism.mesh import AXES
from projection import aot_compile, layout, project
from projection.plan import Target, check_gpus, plan
from projection.prior import GB, Prior, prior
from records.points import ProjectedPoint, SearchChoice
from train import step as train_step

# Compiles per search by default: a GPT-3 175B compile takes 5-15 s here.
DEFAULT_BUDGET = 12
# Pipeline passes tried: fewer passes keep more micro-batches' activations (memory) for
# fewer fill and drain trips (time); pipeline.check drops those that do not divide.
PIPELINE_PASSES = (1, 2, 4, 8, 16)
# Context-parallel sizes tried (parallelism/context.py), from sequences this long: the
# published Llama 3.1 405B runs use 2 at 8,192 tokens (docs/llama.md); GPT-3's 2,048-token
# sequences are searched without it.
CONTEXT_PARALLEL = (1, 2, 4, 8)
CONTEXT_MIN_SEQ_LEN = 8192
STATE_REASON = "memory: parameters and optimizer state over HBM"
_FIELD = re.compile(r"\b(?:model|mesh|train)\.[a-z0-9_]+")


@dataclasses.dataclass(frozen=True)
class Candidate:
  tensor_parallel: int
  pipeline_parallel: int
  virtual_stages: int
  micro_batch: int
  remat: str
  pipeline_passes: int = 1
  one_f_one_b: bool = False
  context_parallel: int = 1
  # mesh.expert: searched for a mixture of experts (`moe`), where the assignments and
  # `apply` set it even at 1; 1 and left as the experiment has it for a dense model.
  expert_parallel: int = 1
  moe: bool = False

  @property
  def schedule(self) -> str:
    if self.one_f_one_b:
      return "1f1b"
    return "interleaved" if self.virtual_stages > 1 else "gpipe"

  def describe(self) -> str:
    context = f"CP {self.context_parallel}, " if self.context_parallel > 1 else ""
    expert = f"EP {self.expert_parallel}, " if self.moe else ""
    return (
      f"TP {self.tensor_parallel}, {expert}{context}PP {self.pipeline_parallel}, "
      f"VS {self.virtual_stages}, micro-batch {self.micro_batch}, "
      f"{self.schedule} in {self.pipeline_passes} pass(es), remat {self.remat}"
    )

  def assignments(self) -> tuple[str, ...]:
    """The `--set` overrides that select this configuration (experiments/overrides.py)."""
    expert = (f"expert_parallel={self.expert_parallel}",) if self.moe else ()
    return (
      f"tensor_parallel={self.tensor_parallel}",
      *expert,
      f"context_parallel={self.context_parallel}",
      f"pipeline_parallel={self.pipeline_parallel}",
      f"virtual_stages={self.virtual_stages}",
      f"train.pipeline_schedule={self.schedule}",
      f"micro_batch={self.micro_batch}",
      f"train.pipeline_passes={self.pipeline_passes}",
      f"remat={self.remat}",
    )

  def apply(self, exp):
    """`exp` with this configuration; data parallelism takes the remaining GPUs."""
    fsdp = exp.mesh.fsdp if exp.mesh.fsdp > 0 else 1
    mesh = dataclasses.replace(
      exp.mesh,
      data=-1,
      fsdp=fsdp,
      tensor=self.tensor_parallel,
      context=self.context_parallel,
      pipeline=self.pipeline_parallel,
    )
    if self.moe:
      mesh = dataclasses.replace(mesh, expert=self.expert_parallel)
    train = dataclasses.replace(
      exp.train,
      micro_batch=self.micro_batch,
      virtual_stages=self.virtual_stages,
      pipeline_schedule=self.schedule,
      pipeline_passes=self.pipeline_passes,
    )
    return dataclasses.replace(
      exp, mesh=mesh, train=train, model=dataclasses.replace(exp.model, remat=self.remat)
    )


@dataclasses.dataclass(frozen=True)
class Result:
  hardware: str
  gpus: int
  ranking: "Ranking"  # every candidate checked; the survivors in the order projected
  records: tuple[ProjectedPoint, ...]  # projections, in the order made, each with `search`
  compiles: int  # new compiles those projections needed

  def best(self, top: int) -> list[ProjectedPoint]:
    """The `top` fastest records that fit; if none fits, the `top` least over capacity."""
    fitting = sorted((r for r in self.records if r.fits), key=lambda r: r.step_time_s)
    if fitting:
      return fitting[:top]
    return sorted(self.records, key=lambda r: r.over_capacity_gb)[:top]


def candidate_of(exp) -> Candidate:
  """`exp`'s own configuration as a candidate of the space (it may not be a valid one)."""
  stages = exp.mesh.pipeline
  one_f_one_b = stages > 1 and exp.train.pipeline_schedule == "1f1b"
  return Candidate(
    exp.mesh.tensor,
    stages,
    exp.train.virtual_stages if stages > 1 else 1,
    exp.train.micro_batch,
    exp.model.remat,
    exp.train.pipeline_passes if stages > 1 and not one_f_one_b else 1,
    one_f_one_b=one_f_one_b,
    context_parallel=exp.mesh.context,
    expert_parallel=exp.mesh.expert if exp.model.moe else 1,
    moe=exp.model.moe,
  )


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def context_sizes(exp) -> list[int]:
  """The context-parallel sizes searched: for sequences of CONTEXT_MIN_SEQ_LEN tokens and
  more (where activations rather than weights fill memory), those of CONTEXT_PARALLEL
  that split the sequence into 2 x CP chunks; 1 alone otherwise. What else refuses a
  size (train_step.build's context checks) prunes it like any other candidate."""
  if exp.model.seq_len < CONTEXT_MIN_SEQ_LEN:
    return [1]
  return [cp for cp in CONTEXT_PARALLEL if exp.model.seq_len % (2 * cp) == 0]


def expert_sizes(exp, hw: Hardware) -> list[int]:
  """The expert-parallel sizes searched: for a mixture of experts, the divisors of
  model.num_experts up to the NVLink domain (every divisor with
  mesh.allow_expert_beyond_nvlink); 1 alone for a dense model. What else refuses a size
  (an expert group x context x tensor that does not fit in the domain, parallelism/mesh.py
  plan; more ranks than GPUs) prunes it like any other candidate."""
  if not exp.model.moe:
    return [1]
  sizes = _divisors(exp.model.num_experts)
  if exp.mesh.allow_expert_beyond_nvlink:
    return sizes
  return [e for e in sizes if e <= hw.nvlink_domain_size]


def _stage_counts(layers: int) -> list[int]:
  """Pipeline stages and virtual stages tried: the divisors of the layer count and, for an
  uneven split (the embedding and the loss counted as layers, pipeline.split), of it + 2."""
  return sorted(set(_divisors(layers)) | set(_divisors(layers + 2)))


def enumerate_space(exp, hw: Hardware) -> Iterator[Candidate]:
  """Every candidate of the space (module docstring, step 1), before any check."""
  stage_counts = _stage_counts(exp.model.stacked_layers)
  routed = exp.model.moe
  for tp in _divisors(hw.nvlink_domain_size):
    for ep in expert_sizes(exp, hw):
      for cp in context_sizes(exp):
        for pp in stage_counts:
          for vs in stage_counts if pp > 1 else [1]:
            for mb in _divisors(exp.train.global_batch):
              for remat in REMAT_POLICIES:
                axes = dict(context_parallel=cp, expert_parallel=ep, moe=routed)
                for passes in PIPELINE_PASSES if pp > 1 else (1,):
                  yield Candidate(tp, pp, vs, mb, remat, passes, **axes)
                if pp > 1:
                  yield Candidate(tp, pp, vs, mb, remat, 1, one_f_one_b=True, **axes)


def _reason(error: UserInputError) -> str:
  """The configuration field a failed check names."""
  found = _FIELD.search(str(error))
  return found.group(0) if found else str(error)


def _abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
  return AbstractMesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))


@dataclasses.dataclass(frozen=True)
class Ranking:
  candidates: int  # enumerated
  pruned: dict[str, int]  # reason -> candidates, most first
  examples: dict[str, str]  # reason -> the first such candidate's error
  survivors: tuple[tuple[Candidate, Prior, layout.ReducedMesh], ...]  # in projection order


def rank(exp, hw: Hardware, gpus: int) -> Ranking:
  """Every candidate checked, the valid ones ordered by their prior."""
  pruned: collections.Counter[str] = collections.Counter()
  examples: dict[str, str] = {}
  survivors = []
  built: dict[tuple, int | UserInputError] = {}
  total = 0
  for candidate in enumerate_space(exp, hw):
    total += 1
    cand_exp = candidate.apply(exp)
    try:
      reduced = plan(cand_exp, hw, gpus).reduced
      stages = reduced.target.sizes["pipeline"]
      # What model/moe.py runs (the experts over mesh.expert), before the pipeline's
      # checks. A dense model passes.
      moe.check_mesh(cand_exp.model, reduced.sizes)
      if stages > 1:
        micro = reduced.micro_batches
        schedule = cand_exp.train.pipeline_schedule
        pipeline.check(
          cand_exp.model.stacked_layers,
          stages,
          candidate.virtual_stages,
          micro,
          pipeline.passes(cand_exp.train.pipeline_passes, micro, stages, schedule),
          schedule,
        )
        gradients.check_scales(
          cand_exp.train.pipeline_schedule, stages, cand_exp.model.delayed_scaling
        )
      # The model's shapes over the model-parallel axes: once the checks above pass, the
      # same for every micro-batch, virtual-stage count (a reordering of the layers) and
      # remat policy, so built once per (fsdp, tensor, pipeline).
      key = tuple(reduced.sizes[a] for a in AXES if a != "data")
      if key not in built:
        try:
          train_cfg = dataclasses.replace(cand_exp.train, global_batch=reduced.global_batch)
          mesh = _abstract_mesh(reduced.sizes)
          program = train_step.build(cand_exp.model, train_cfg, mesh, getattr(exp, "lora", None))
          built[key] = sharding.bytes_per_device(program.abstract_state)
        except UserInputError as e:
          built[key] = e
      if isinstance(built[key], UserInputError):
        raise built[key]
    except UserInputError as e:
      pruned[_reason(e)] += 1
      examples.setdefault(_reason(e), str(e))
      continue
    if built[key] > hw.hbm_bytes:
      pruned[STATE_REASON] += 1
      examples.setdefault(
        STATE_REASON, f"{candidate.describe()}: {built[key] / GB:.1f} of {hw.hbm_bytes / GB:.1f} GB"
      )
      continue
    survivors.append((candidate, prior(cand_exp, hw, reduced, built[key]), reduced))
  capacity_gb = hw.hbm_bytes / GB
  survivors.sort(key=lambda s: (s[1].memory_gb > capacity_gb, s[1].step_s))
  return Ranking(total, dict(pruned.most_common()), examples, tuple(survivors))


# (experiment, target, how) -> its projection: projection/project.py's `project`.
Projector = Callable[[object, Target, str], ProjectedPoint]


def search(
  exp,
  hw: Hardware,
  gpus: int,
  budget: int = DEFAULT_BUDGET,
  how: str = "auto",
  projector: Projector | None = None,
  progress: Callable[[int, int, Candidate], None] | None = None,
  on_record: Callable[[ProjectedPoint], None] | None = None,
  include: Candidate | None = None,
) -> Result:
  """Search `exp`'s parallelism on `gpus` GPUs of `hw`, projecting at most `budget`
  candidates as `how` says (tests pass a `projector` that does not compile), and `include`
  first where it is valid, whatever its prior. `progress(done, to_do, candidate)` is
  called before each projection, `on_record(record)` after it."""
  if budget < 1:
    raise UserInputError(f"--search_budget must be a positive whole number, got {budget}")
  check_gpus(hw, gpus)
  projector = projector or project.project
  ranking = rank(exp, hw, gpus)
  if not ranking.survivors:
    reasons = "; ".join(f"{n} by {why}" for why, n in ranking.pruned.items())
    most = next(iter(ranking.pruned))  # most_common order
    raise UserInputError(
      f"--gpus {gpus} on {hw.name}: none of the {ranking.candidates} "
      f"parallelism configurations of {exp.name} is valid ({reasons}; e.g. "
      f"{ranking.examples[most]})"
    )
  before = aot_compile.compile_step.cache_info().misses
  records = []
  rank_of = {s[0]: i for i, s in enumerate(ranking.survivors)}
  chosen = [c for c, _, _ in ranking.survivors[:budget]]
  if include in rank_of:
    chosen = [include] + [c for c in chosen if c != include]
  for i, candidate in enumerate(chosen):
    _, estimate, reduced = ranking.survivors[rank_of[candidate]]
    if progress:
      progress(i, len(chosen), candidate)
    choice = SearchChoice(
      prior_rank=rank_of[candidate],
      included=candidate == include,
      set=list(candidate.assignments()),
      tensor_parallel=candidate.tensor_parallel,
      expert_parallel=candidate.expert_parallel if candidate.moe else None,
      context_parallel=candidate.context_parallel,
      pipeline_parallel=candidate.pipeline_parallel,
      virtual_stages=candidate.virtual_stages,
      micro_batch=candidate.micro_batch,
      pipeline_passes=candidate.pipeline_passes,
      schedule=(
        candidate.schedule
        if candidate.pipeline_passes == 1
        else f"{candidate.schedule} x {candidate.pipeline_passes}"
      ),
      remat=candidate.remat,
      prior_step_s=estimate.step_s,
      prior_memory_gb=estimate.memory_gb,
      prior_bubble_fraction=estimate.bubble_fraction,
      candidates=ranking.candidates,
      pruned=ranking.pruned,
      valid=len(ranking.survivors),
      budget=budget,
    )
    point = projector(candidate.apply(exp), Target(hw, reduced), how)
    record = dataclasses.replace(point, search=choice)
    records.append(record)
    if on_record:
      on_record(record)
  compiles = aot_compile.compile_step.cache_info().misses - before
  return Result(hw.name, gpus, ranking, tuple(records), compiles)
