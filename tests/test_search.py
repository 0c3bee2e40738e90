"""The parallelism search (projection/search.py): enumeration against the shape rules,
pruning, the prior's order, the budget, the ranking, and launch.py's search mode.

Only the launch.py test compiles (one deviceless compile of the tiny experiment); the
others rank candidates (no compile) or project with a stand-in projector.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

import experiments
from errors import UserInputError
from experiments import ExperimentConfig, overrides
from hardware import catalog
from model.config import REMAT_POLICIES
from parallelism.mesh import MeshConfig
from projection import prior, search, targets
from projection.plan import plan
from records.points import ProjectedPoint, to_json
from report import points as printers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CUDA, _WHY = targets.cuda_available()
H100 = catalog.get("h100")


@pytest.fixture(scope="module")
def small(toy_experiment):
  """The toy experiment (tests/conftest.py) on one 8-GPU H100 node, data-parallel."""
  return toy_experiment("small")


def _valid_by_the_rules(exp: ExperimentConfig, c: search.Candidate, gpus: int = 8) -> bool:
  """The shape rules, written out independently of the checks the search reuses."""
  m, t = exp.model, exp.train
  tp, pp, vs, mb = c.tensor_parallel, c.pipeline_parallel, c.virtual_stages, c.micro_batch
  if m.num_heads % tp or H100.nvlink_domain_size % tp or gpus % (tp * pp):
    return False
  chunks = pp * vs
  # Equal chunks, or with the embedding and the loss counted as layers (2 slots or more).
  if m.num_layers % chunks and ((m.num_layers + 2) % chunks or m.num_layers + 2 < 2 * chunks):
    return False
  data = gpus // (tp * pp)
  if t.global_batch % (data * mb):
    return False
  micro_batches = t.global_batch // data // mb
  if c.one_f_one_b:
    return micro_batches % pp == 0
  if micro_batches % c.pipeline_passes:
    return False
  return vs == 1 or micro_batches // c.pipeline_passes >= pp


def test_enumeration_and_pruning_follow_the_shape_rules(small):
  ranking = search.rank(small, H100, 8)
  space = list(search.enumerate_space(small, H100))
  # TP over the divisors of the NVLink domain, PP and VS over those of the layers (4) and
  # of the layers + 2 (6): 1, 2, 3, 4, 6 (VS and schedules only with a pipeline: 1f1b, or
  # lockstep in each number of passes), micro-batches over the divisors of the global
  # batch, every remat; no context parallelism at 128 tokens.
  pipelined = 4 * 5 * (len(search.PIPELINE_PASSES) + 1)
  assert ranking.candidates == len(space) == 4 * (1 + pipelined) * 5 * len(REMAT_POLICIES)
  survivors = [c for c, _, _ in ranking.survivors]
  assert set(survivors) == {c for c in space if _valid_by_the_rules(small, c)}
  assert len(survivors) + sum(ranking.pruned.values()) == ranking.candidates
  # Each pruned candidate counts once, under the field its first failing check names.
  assert set(ranking.pruned) == {
    "mesh.data",
    "model.num_heads",
    "model.num_layers",
    "train.micro_batch",
    "train.pipeline_passes",
    "train.pipeline_schedule",
    "train.virtual_stages",
  }
  assert (
    "model.num_heads = 2 does not divide over mesh tensor = 4"
    in (ranking.examples["model.num_heads"])
  )
  assert all(c.tensor_parallel <= 2 for c in survivors)
  # The prior: those estimated to fit first, each group by estimated step time.
  keys = [(p.memory_gb > H100.hbm_bytes / 1e9, p.step_s) for _, p, _ in ranking.survivors]
  assert keys == sorted(keys)
  bubbles = {
    (c.pipeline_parallel, c.virtual_stages, c.micro_batch): p.bubble_fraction
    for c, p, _ in ranking.survivors
    if c.pipeline_passes == 1
  }
  assert bubbles[(2, 1, 1)] == pytest.approx(1 / 5)  # 4 micro-batches: (P-1) / (M V + P - 1)
  assert bubbles[(1, 1, 1)] == 0


def test_delayed_fp8_scaling_prunes_the_lockstep_schedules(small):
  # Pipelined delayed scaling runs only under 1f1b (parallelism/gradients.py check_scales): the
  # lockstep candidates that were valid are pruned under its field (with others that a
  # later check would have pruned), the rest stay.
  delayed = dataclasses.replace(
    small, model=dataclasses.replace(small.model, fp8=True, fp8_amax_history=16)
  )
  before = {c for c, _, _ in search.rank(small, H100, 8).survivors}
  ranking = search.rank(delayed, H100, 8)
  after = {c for c, _, _ in ranking.survivors}
  lockstep = {c for c in before if c.pipeline_parallel > 1 and not c.one_f_one_b}
  assert lockstep and after == before - lockstep
  assert ranking.pruned["model.fp8_amax_history"] >= len(lockstep)


def test_long_sequences_search_context_parallelism(toy_experiment):
  # At 8,192 tokens the space has context 1, 2, 4 and 8 (projection/search.py
  # CONTEXT_PARALLEL); on one 8-GPU node tensor x context x pipeline must fit in it, and
  # the toy's 2 heads cap tensor at 2. Unpipelined, a GPU holds one micro-batch's
  # activations, of which a context rank has half the tokens: the estimate halves.
  long = toy_experiment("long", seq_len=8192)
  assert search.context_sizes(long) == [1, 2, 4, 8] and search.context_sizes(
    toy_experiment("short")
  ) == [1]
  ranking = search.rank(long, H100, 8)
  by_candidate = {c: p for c, p, _ in ranking.survivors}
  assert {c.context_parallel for c in by_candidate} == {1, 2, 4, 8}
  assert all(
    c.tensor_parallel * c.context_parallel * c.pipeline_parallel <= 8 for c in by_candidate
  )
  one = next(
    c
    for c in by_candidate
    if (c.context_parallel, c.tensor_parallel, c.pipeline_parallel) == (1, 2, 1)
  )
  two = dataclasses.replace(one, context_parallel=2)
  assert by_candidate[two].activations_gb == pytest.approx(by_candidate[one].activations_gb / 2)
  assert "context_parallel=2" in two.assignments()
  assert two.apply(long).mesh.context == 2


def test_state_over_hbm_is_pruned(small):
  # HBM for a third of the unsharded parameters and optimizer state: only layouts that
  # split the layers 4 ways hold them (the embeddings are not split over the pipeline).
  whole = next(
    p.state_gb
    for c, p, _ in search.rank(small, H100, 8).survivors
    if (c.tensor_parallel, c.pipeline_parallel) == (1, 1)
  )
  little = dataclasses.replace(H100, hbm_gib=whole / 3 * 1e9 / 2**30)
  ranking = search.rank(small, little, 8)
  assert ranking.pruned[search.STATE_REASON] > 0
  assert ranking.survivors
  assert all(c.tensor_parallel * c.pipeline_parallel >= 4 for c, _, _ in ranking.survivors)
  assert all(p.state_gb <= little.hbm_bytes / 1e9 for _, p, _ in ranking.survivors)


@pytest.fixture(scope="module")
def moe_exp():
  """The moe experiment: moe-tiny (8 experts, 3 layers of which 2 routed), 16 sequences."""
  return experiments.load("moe")


@pytest.fixture(scope="module")
def moe_ranking(moe_exp):
  """Its search on two 8-GPU H100 nodes (the one MoE ranking of this file: about 5 s)."""
  return search.rank(moe_exp, H100, 16)


def _moe(exp: ExperimentConfig, num_experts: int = 8, beyond: bool = False) -> ExperimentConfig:
  return dataclasses.replace(
    exp,
    model=dataclasses.replace(exp.model, num_experts=num_experts),
    mesh=dataclasses.replace(exp.mesh, allow_expert_beyond_nvlink=beyond),
  )


def test_moe_search_enumerates_the_expert_sizes_that_divide_the_experts(moe_exp, small):
  # 12 experts: 1, 2, 3, 4 and 6 fit in an 8-GPU node's NVLink domain by size (12 does
  # not); beyond it allowed, 12 too. A dense model's candidates keep mesh.expert.
  twelve = _moe(moe_exp, 12)
  assert search.expert_sizes(twelve, H100) == [1, 2, 3, 4, 6]
  assert search.expert_sizes(_moe(moe_exp, 12, beyond=True), H100) == [1, 2, 3, 4, 6, 12]
  space = list(search.enumerate_space(twelve, H100))
  assert {c.expert_parallel for c in space} == {1, 2, 3, 4, 6}
  assert {(c.expert_parallel, c.moe) for c in search.enumerate_space(small, H100)} == {(1, False)}
  # Every other axis as for a dense model, the pipeline over the 2 routed layers (1, 2, 4).
  dense = {dataclasses.replace(c, expert_parallel=1, moe=False) for c in space}
  assert len(space) == 5 * len(dense)
  assert {c.pipeline_parallel for c in space} == {1, 2, 4}
  # The candidate sets mesh.expert, even at 1, and says so.
  one = next(c for c in space if c.expert_parallel == 1)
  assert "expert_parallel=1" in one.assignments() and ", EP 1, " in one.describe()
  assert one.apply(twelve).mesh.expert == 1 and twelve.mesh.expert == 2
  assert search.candidate_of(twelve) == dataclasses.replace(
    search.candidate_of(small), tensor_parallel=2, expert_parallel=2, moe=True, remat="none"
  )


def test_moe_expert_groups_beyond_nvlink_are_pruned(moe_exp, moe_ranking):
  # On two 8-GPU nodes, expert x tensor = 16 crosses the NVLink domain: pruned under
  # mesh.expert unless the experiment allows it. Pipelined, the lockstep schedules survive
  # too.
  survivors = [c for c, _, _ in moe_ranking.survivors]
  assert {c.expert_parallel for c in survivors} == {1, 2, 4, 8}
  example = moe_ranking.examples["mesh.expert"]
  assert "mesh.expert 8 (x context 1 x tensor 2 = 16 devices)" in example
  assert "allow_expert_beyond_nvlink" in example
  assert all(c.expert_parallel * c.tensor_parallel <= 8 for c in survivors)
  pipelined = [c for c in survivors if c.pipeline_parallel > 1]
  assert {c.one_f_one_b for c in pipelined} == {True, False}
  wide = next(c for c in search.enumerate_space(moe_exp, H100) if c.expert_parallel == 8)
  wide = dataclasses.replace(wide, tensor_parallel=2)
  with pytest.raises(UserInputError, match="mesh.expert 8"):
    plan(wide.apply(moe_exp), H100, 16)
  plan(wide.apply(_moe(moe_exp, beyond=True)), H100, 16)  # allowed


def test_the_prior_prices_expert_all_to_alls_on_the_network_that_holds_the_group(moe_exp):
  # 16 experts on two H100 nodes, a sequence a replica: an expert group of 16 spans both
  # nodes, half its all-to-all over the NICs; one of 8 sits in a node, over NVLink. The
  # buffers a GPU sends are alike (16 replicas of the batch either way), so the group
  # across the nodes costs more; and the same group in one 16-GPU NVLink domain less.
  sixteen = _moe(moe_exp, 16, beyond=True)
  base = search.Candidate(1, 1, 1, 1, "none", expert_parallel=8, moe=True)

  def estimate(candidate, hw=H100):
    exp = candidate.apply(sixteen)
    return prior.prior(exp, hw, plan(exp, hw, 16).reduced, 0)

  inside, across = estimate(base), estimate(dataclasses.replace(base, expert_parallel=16))
  assert 0 < inside.expert_s < across.expert_s
  assert estimate(dataclasses.replace(base, expert_parallel=1)).expert_s == 0
  one_domain = dataclasses.replace(H100, gpus_per_node=16, nvlink_domain_size=16)
  wide = dataclasses.replace(base, expert_parallel=16)
  assert estimate(wide, one_domain).step_s < across.step_s


def test_a_moe_search_records_its_expert_parallelism(moe_exp, moe_ranking, small, monkeypatch):
  dense = search.search(small, H100, 8, budget=1, projector=_fake_projector({"none"}))
  assert "expert_parallel" not in _json(dense.records)[0]["search"]  # dense: nothing of it
  monkeypatch.setattr(search, "rank", lambda *args: moe_ranking)
  found = search.search(moe_exp, H100, 16, budget=2, projector=_fake_projector({"none"}))
  for record in _json(found.records):
    s = record["search"]
    assert f"expert_parallel={s['expert_parallel']}" in s["set"]
    assert f" EP{s['expert_parallel']} " in printers.configuration_text(record)
    assert overrides.apply(moe_exp, s["set"]).mesh.expert == s["expert_parallel"]
  table = printers.search_table(moe_exp, found, 1.0, 2)
  assert next(line for line in table.splitlines() if line.startswith("TP")).split()[:2] == [
    "TP",
    "EP",
  ]


def _fake_projector(fitting_remat: set[str]):
  """Records without a compile: fitting for the given remat policies, a made-up step time
  that orders them otherwise than the prior does."""

  def project(exp, target, how):
    fits = exp.model.remat in fitting_remat
    record = {
      "fits": fits,
      "mesh": target.reduced.target.sizes,
      "memory_per_gpu_gb": 1.0,
      "hbm_capacity_gb": target.hardware.hbm_bytes / 1e9,
    }
    if fits:
      record["step_time_s"] = 1.0 + 0.1 * exp.train.micro_batch + (exp.model.remat == "full")
    else:
      record["over_capacity_gb"] = float(exp.train.micro_batch)
    return _point(**record)

  return project


def _point(**fields) -> ProjectedPoint:
  """A ProjectedPoint of `fields`, the rest placeholders."""
  names = [f.name for f in dataclasses.fields(ProjectedPoint) if f.name not in fields]
  return ProjectedPoint(**{name: None for name in names}, **fields)


def _json(records) -> list[dict]:
  return [to_json(r) for r in records]


def test_budget_is_honoured_and_the_fastest_that_fits_ranks_first(small):
  appended = []
  found = search.search(
    small,
    H100,
    8,
    budget=7,
    projector=_fake_projector({"save_dots", "elementwise", "full"}),
    on_record=appended.append,
  )
  assert len(found.records) == 7 and found.compiles == 0
  assert appended == list(found.records)
  # Projected in prior order, each record marked as a search point.
  assert [r["search"]["prior_rank"] for r in _json(found.records)] == list(range(7))
  assert [r["search"]["set"] for r in _json(found.records)] == [
    list(c.assignments()) for c, _, _ in found.ranking.survivors[:7]
  ]
  assert all(r["search"]["valid"] == len(found.ranking.survivors) for r in _json(found.records))
  fitting = [r for r in _json(found.records) if r["fits"]]
  assert 2 < len(fitting) < 7
  best = _json(found.best(2))
  assert best == sorted(fitting, key=lambda r: r["step_time_s"])[:2]
  assert all(best[0]["step_time_s"] <= r["step_time_s"] for r in fitting)
  assert best[0]["search"]["prior_rank"] > 0  # the fastest, not the prior's first
  # Nothing fits: the least over capacity.
  found = search.search(small, H100, 8, budget=3, projector=_fake_projector(set()))
  assert len(found.records) == 3 and not any(r["fits"] for r in _json(found.records))
  over = [r["over_capacity_gb"] for r in _json(found.best(3))]
  assert over == sorted(over)


def test_no_valid_configuration_is_bad_input(small):
  one = dataclasses.replace(
    small, mesh=MeshConfig(data=-1, fsdp=2), train=dataclasses.replace(small.train, global_batch=1)
  )
  with pytest.raises(UserInputError, match="--gpus 8 on h100: none of the .* is valid"):
    search.search(one, H100, 8, budget=1, projector=_fake_projector(set()))


def _launch(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  return subprocess.run(
    [sys.executable, "launch.py", "--mode=search", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
def test_search_mode_prints_the_best_and_appends_search_points(tmp_path):
  out = _launch(
    "--experiment=tiny",
    "--hardware=h100",
    "--gpus=8",
    "--search_budget=1",
    "--top=1",
    f"--output_dir={tmp_path}",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "projected in prior order (1 new compiles)" in out.stdout
  assert "best: --set tensor_parallel=" in out.stdout
  (record,) = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
  assert record["mode"] == "project" and record["search"]["prior_rank"] == 0
  assert record["fits"] and record["step_time_s"] > 0


def test_search_bad_gpu_count_is_one_line_and_exit_2(tmp_path):
  out = _launch("--experiment=tiny", "--hardware=h100", "--gpus=12", f"--output_dir={tmp_path}")
  assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
  lines = out.stderr.strip().splitlines()
  assert lines == ["error: --gpus 12 is not a whole number of 8-GPU nodes"]
  assert not (tmp_path / "results.jsonl").exists()
