"""Projection (projection/project.py and the modules it joins): compile reuse and its
agreement with direct compiles, matmul FLOPs, HBM capacity, placement on the target, the
cost model's streams, and bad input in project mode (one case through launch.py).

A deviceless GPU compile takes 10-20 s here whatever the model's size, so the small-model
tests share three H100 compiles (compile_step's cache) and GPT-3 175B is compiled once;
those tests are skipped where jax-cuda12-plugin cannot compile deviceless.

Every figure compared here is Python float arithmetic over the compiled HLO, and XLA's
deviceless GPU compile is a deterministic function of the program and the target: the
same on any machine with the pinned jax. pytest.approx's default (1e-6 relative) absorbs
only float rounding where two formulas compute one quantity in another order; a wider
bound compares two methods, and its reason is beside it.
"""

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
from collections import Counter

import jax
import pytest
from projected import projected

import experiments
from errors import UserInputError
from experiments import ExperimentConfig
from hardware import catalog
from model.flops import matmul_flops_per_step
from modes import options as options_lib
from modes import project as project_mode
from parallelism.mesh import MeshConfig, build_mesh, plan
from projection import (
  aot_compile,
  collective_timing,
  collectives,
  cost_model,
  disk_cache,
  hlo,
  layout,
  project,
  step_loops,
  targets,
)
from projection.plan import Target
from projection.plan import plan as plan_target
from records.points import to_json
from train import step as train_step
from train.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CUDA, _WHY = targets.cuda_available()
deviceless = pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")

H100 = catalog.get("h100")


@pytest.fixture(scope="module")
def small(toy_experiment):
  """One model replica (fsdp 2 x tensor 4) fills an 8-GPU H100 node: the wide toy
  (tests/conftest.py) with 2 layers, fully rematerialised. With micro-batches of one
  sequence, 64 GPUs (data 8) run 8 micro-batches and 128 GPUs (data 16) run 4; both
  compile as data 2 with 2 micro-batches (global batch 8)."""
  return toy_experiment(
    "small",
    mesh=MeshConfig(data=-1, fsdp=2, tensor=4),
    train=TrainConfig(global_batch=128, micro_batch=1),
    shape="wide",
    num_layers=2,
    remat="full",
  )


def _with_batch(exp: ExperimentConfig, global_batch: int) -> ExperimentConfig:
  return dataclasses.replace(exp, train=dataclasses.replace(exp.train, global_batch=global_batch))


def _direct(exp: ExperimentConfig, gpus: int) -> dict:
  """The projection from a compile of the whole target mesh and all its micro-batches."""
  reduced = plan_target(exp, H100, gpus).reduced
  whole = layout.ReducedMesh(
    reduced.target,
    reduced.target.sizes,
    exp.train.global_batch,
    reduced.micro_batches,
    reduced.micro_batches,
  )
  return to_json(project.whole(exp, Target(H100, whole)))


def _rel(a: float, b: float) -> float:
  return abs(a - b) / b


# ----------------------------------------------------------------------------- compiles
@deviceless
def test_data_axis_2_extended_to_16_matches_a_compile_at_16(small):
  # Global batch 64 on 128 GPUs: 2 micro-batches, as compiled, so only the data axis grows.
  # The optimizer is split over data: its reduce-scatters and all-gathers grow their
  # groups, not their bytes, and its memory shrinks with the axis. (The next test extends
  # a replicated optimizer's all-reduces the same way, with micro-batches.)
  exp = _with_batch(small, 64)
  exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, shard_optimizer=True))
  extended, direct = projected(exp, "h100", 128), _direct(exp, 128)
  assert (extended["compiled_mesh"]["data"], direct["compiled_mesh"]["data"]) == (2, 16)
  assert extended["micro_batches"] == extended["compiled_micro_batches"] == 2
  # Two programs: XLA schedules the bigger compile's overlap a little differently.
  assert _rel(extended["step_time_s"], direct["step_time_s"]) < 0.02
  assert _rel(extended["comm_s"], direct["comm_s"]) < 0.02
  assert extended["hlo_matmul_flops_per_step"] == direct["hlo_matmul_flops_per_step"]
  # The split state is corrected to the target's data size; XLA's temporaries for the
  # update (1/data slices of the gradients) are not, so memory is overstated, not under.
  memory, direct_memory = extended["memory_per_gpu_gb"], direct["memory_per_gpu_gb"]
  # 0.1%: rounding of the GB figures; 10%: the uncorrected update temporaries.
  assert direct_memory <= memory * 1.001 and _rel(memory, direct_memory) < 0.1


@deviceless
def test_gpu_counts_share_one_compile_and_match_a_direct_compile(small):
  before = aot_compile.compile_step.cache_info()
  r64, r128 = projected(small, "h100", 64), projected(small, "h100", 128)
  after = aot_compile.compile_step.cache_info()
  assert after.misses - before.misses <= 1 and after.hits - before.hits >= 1
  assert (
    r64["compiled_mesh"]
    == r128["compiled_mesh"]
    == {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 4, "pipeline": 1}
  )
  assert (r64["micro_batches"], r128["micro_batches"]) == (8, 4)
  assert r64["compiled_micro_batches"] == r128["compiled_micro_batches"] == 2
  # Per GPU, 64 GPUs run twice the micro-batches of 128: twice the matmuls, no more.
  assert r64["hlo_matmul_flops_per_step"] / 64 == 2 * r128["hlo_matmul_flops_per_step"] / 128
  direct = _direct(small, 128)  # data 16, 4 micro-batches, compiled as such
  assert direct["compiled_micro_batches"] == 4
  # Two programs (2 micro-batches extended to 4, against 4 compiled): XLA's schedule and
  # buffer assignment differ a little; FLOPs are counted exactly.
  assert _rel(r128["step_time_s"], direct["step_time_s"]) < 0.02
  assert r128["hlo_matmul_flops_per_step"] == direct["hlo_matmul_flops_per_step"]
  assert r128["memory_per_gpu_gb"] == pytest.approx(direct["memory_per_gpu_gb"], rel=0.05)


@deviceless
def test_a_projected_point_is_read_back_from_the_compile_cache(small, tmp_path, monkeypatch):
  monkeypatch.setenv(aot_compile.COMPILE_CACHE_ENV, str(tmp_path))
  first = projected(small, "h100", 64)
  assert len(list(tmp_path.iterdir())) == 1

  def no_compile(*args, **kwargs):
    raise AssertionError("compiled again")

  monkeypatch.setattr(aot_compile, "compile_step", no_compile)
  again = projected(small, "h100", 64)
  assert (first["compile_cached"], again["compile_cached"]) == (False, True)
  for field in ("step_time_s", "memory_per_gpu_gb", "hlo_matmul_flops_per_step", "breakdown"):
    assert again[field] == first[field]  # the same program, costed by the same arithmetic
  # Another target (the timer places collectives on it) and other code make other keys.
  with pytest.raises(AssertionError, match="compiled again"):
    projected(small, "h100", 128)
  monkeypatch.setattr(disk_cache, "code_digest", lambda: "other code")
  with pytest.raises(AssertionError, match="compiled again"):
    projected(small, "h100", 64)


@deviceless
def test_over_capacity_is_reported_without_a_step_time(small):
  fits = projected(small, "h100", 128)
  assert fits["fits"] and fits["step_time_s"] > 0 and "over_capacity_gb" not in fits
  # The same program on an H100 with 1 MiB of memory (compile_step's cache is keyed by
  # the hardware's name, so this reuses the compile above).
  tiny = dataclasses.replace(H100, hbm_gib=1 / 1024)
  record = to_json(project.project(small, plan_target(small, tiny, 128), "full"))
  assert record["memory_per_gpu_gb"] > record["hbm_capacity_gb"]
  assert record["fits"] is False
  assert record["over_capacity_gb"] == pytest.approx(
    record["memory_per_gpu_gb"] - record["hbm_capacity_gb"]
  )
  assert not {"step_time_s", "breakdown", "mfu"} & record.keys()


@deviceless
def test_gpt3_175b_matmul_flops_match_the_analytical_count():
  exp = experiments.load("gpt3")
  record = projected(exp, "h100", 512)
  assert (record["micro_batches"], record["compiled_micro_batches"]) == (24, 2)
  expected = matmul_flops_per_step(exp.model, exp.train.global_batch)
  # The formula counts the model's matmuls; the HLO also has the attention's and remat's
  # small extras (model/flops.py), under 2% at 175B.
  assert _rel(record["hlo_matmul_flops_per_step"], expected) < 0.02
  assert record["fits"] and 40 < record["memory_per_gpu_gb"] < record["hbm_capacity_gb"]


@deviceless
def test_latency_profile_names_the_instructions_xla_schedules(small, capfd, monkeypatch):
  # XLA logs how many of the instructions it schedules it found in the profile and lists
  # the rest; the projection's profile must name them as XLA scheduled them (a
  # while-loop condition, which XLA does not schedule, may be missing).
  monkeypatch.setattr(aot_compile.platform_env, "captured_stderr", contextlib.nullcontext)
  exp = dataclasses.replace(small, latency_profile=True)
  reduced = plan_target(exp, H100, 256).reduced
  timer = collective_timing.collective_timer(reduced, H100)
  untuned, _ = aot_compile.compiled_program(
    dataclasses.replace(exp, latency_profile=False), H100, reduced, timer
  )
  capfd.readouterr()
  before = aot_compile.compile_step.cache_info().misses
  tuned, compile_s = aot_compile.compiled_program(exp, H100, reduced, timer)
  log = capfd.readouterr().err
  assert aot_compile.compile_step.cache_info().misses == before + 1
  assert compile_s == pytest.approx(untuned.compile_s + tuned.compile_s)
  found = int(re.search(r"Found (\d+) instructions from the profile", log).group(1))
  missing = re.search(r"Missing (\d+) instructions from the profile", log)
  profile = aot_compile.latency_profile(untuned.program, H100, timer)
  assert found >= 0.9 * len(profile)
  assert missing is None or int(missing.group(1)) <= 0.05 * found
  # The profile's collectives cost what the projection costs them.
  costs = dict(profile)
  for node, _ in hlo.collectives(untuned.program):
    assert costs[node.scheduling_name] == pytest.approx(timer(node) * 1e6)
  # Another profile compiles again on the lowering the tuned compile left: a profile changes
  # only XLA's schedule, so a point's two compiles lower the step once.
  lowerings = aot_compile._lowered_step.cache_info().misses
  train_cfg = dataclasses.replace(exp.train, global_batch=reduced.global_batch)
  args = (exp.model, train_cfg, tuple(reduced.sizes.items()), H100.name, H100.gpus_per_node)
  doubled = tuple((name, 2 * cost_us) for name, cost_us in profile)
  assert aot_compile.compile_step(*args, doubled, exp.lora).program is not None
  assert aot_compile._lowered_step.cache_info().misses == lowerings


def test_save_dots_matmul_flops_and_the_named_loop_on_cpu(toy_experiment):
  # One CPU device, 2 micro-batches run to 5 through the named accumulation loop; save_dots
  # adds the recomputed attention matmuls to the 3 x forward of remat none. (Full remat is
  # checked on GPT-3 175B above; a CPU compile costs 5-15 s here, so one policy.)
  model = toy_experiment(num_layers=3, remat="save_dots", compute_dtype="float32").model
  mesh = build_mesh(plan(MeshConfig(data=1), 1), jax.devices()[:1])
  step = train_step.build(model, TrainConfig(global_batch=2, micro_batch=1), mesh)
  program = hlo.analyze(step.lower(2, model.seq_len).compile().as_text())
  assert hlo.dot_flops(program) == matmul_flops_per_step(model, 2)
  five = step_loops.with_micro_batches(program, compiled=2, target=5)
  assert hlo.dot_flops(five) == matmul_flops_per_step(model, 5)


# ----------------------------------------------------------------------------- no compiles
def _loop(name: str, op_name: str, trips: int, body: tuple = ()) -> hlo.Loop:
  return hlo.Loop(name, trips, body, "backend_config", op_name)


def test_with_micro_batches_sets_only_the_named_loop():
  layer = _loop("layers", "jit(train_step)/grad_accumulation/while/body/jvp()/while", 12)
  accumulation = _loop("acc", "jit(train_step)/grad_accumulation/while", 2, (layer,))
  program = hlo.Program("m", 8, (_loop("other", "jit(train_step)/while", 2), accumulation))
  extended = step_loops.with_micro_batches(program, compiled=2, target=24)
  assert [n.trip_count for n in extended.entry] == [2, 24]
  assert extended.entry[1].body == (layer,)
  assert step_loops.with_micro_batches(program, compiled=2, target=2) is program
  with pytest.raises(RuntimeError, match="one gradient-accumulation loop"):
    step_loops.with_micro_batches(hlo.Program("m", 8, (layer,)), compiled=2, target=24)


def test_plan_reduces_any_data_size_and_checks_the_micro_batch():
  gpt3 = experiments.load("gpt3")
  for gpus, data, reduced_data, micro in [(64, 1, 1, 192), (192, 3, 2, 64), (1024, 16, 2, 12)]:
    reduced = plan_target(gpt3, H100, gpus).reduced
    assert reduced.target.sizes["data"] == data and reduced.sizes["data"] == reduced_data
    assert (reduced.micro_batches, reduced.compiled_micro_batches) == (micro, 2)
    assert reduced.global_batch == reduced_data * 8 * 2  # replicas x 2 micro-batches of 1
  five = dataclasses.replace(gpt3, train=dataclasses.replace(gpt3.train, micro_batch=5))
  with pytest.raises(
    UserInputError,
    match="train.micro_batch = 5 does not divide the 24 "
    "sequences per data-parallel replica of 512 GPUs",
  ):
    plan_target(five, H100, 512).reduced
  # A group along data (partitions 0 and 64 of the 2 x 8 x 8 reduced mesh) grows to 3.
  reduced = plan_target(gpt3, H100, 192).reduced
  (domains,) = layout.target_group_domains(((0, 64),), reduced)
  assert len(domains) == 3 and len(set(domains)) == 3  # three nodes over InfiniBand


def test_groups_straddling_nvl72_racks_are_costed_at_the_slowest():
  # 64-GPU replicas laid over whole 72-GPU NVL72 racks (plan keeps them inside
  # racks instead, tests/test_mlperf.py): replica 0's fsdp groups sit in rack 0, later
  # replicas straddle two racks, so the same all-gather crosses InfiniBand there.
  gb200, gpt3 = catalog.get("gb200"), experiments.load("gpt3")
  reduced = layout.reduce(layout.target_layout(gpt3.mesh, 512, 4, 72), gpt3.train)
  fsdp_groups = tuple(tuple(range(t, 64, 8)) for t in range(8))
  counts = {
    tuple(sorted(Counter(domains).values()))
    for domains in layout.target_group_domains(fsdp_groups, reduced)
  }
  assert (8,) in counts and (1, 7) in counts
  gather = hlo.Collective("ag", "all-gather", 150 * 2**20, "bf16", fsdp_groups)
  in_rack = collectives.collective_time_s("all-gather", gather.bytes, [0] * 8, gb200)
  straddling = collectives.collective_time_s("all-gather", gather.bytes, [0] + [1] * 7, gb200)
  assert collective_timing.collective_timer(reduced, gb200)(gather) == straddling > 3 * in_rack


def test_sync_collective_waits_for_the_communication_stream():
  one_second = lambda node: 1.0
  nodes = (
    hlo.Collective("a", "all-reduce", 1, "f32", ((0, 1),), is_async=True),
    hlo.Collective("s", "all-reduce", 1, "f32", ((0, 1),)),
    hlo.AsyncDone("a-done", "a"),
  )
  cost = cost_model.simulate(nodes, H100, one_second)
  # The async one holds the links for 1 s; the sync one runs after it, and the compute
  # stream waits for both.
  assert cost.step_s == cost.exposed_comm_s == 2.0 and cost.comm_s == 2.0


def test_exposed_time_is_split_by_collective_and_the_loop_it_waits_in():
  one_second = lambda node: 1.0
  gather = hlo.Collective("g", "all-gather", 1, "bf16", ((0, 1),), is_async=True)
  scatter = hlo.Collective("r", "reduce-scatter", 1, "bf16", ((0, 1),), is_async=True)
  body = (scatter, hlo.AsyncDone("r-done", "r"))
  drain = hlo.Loop("while.7", 3, body, "backend_config", "jit(f)/vmap(pipeline_drain)/while")
  unnamed = hlo.Loop("while.8", 2, body, "backend_config", "jit(f)/while")
  nodes = (gather, hlo.AsyncDone("g-done", "g"), drain, unnamed)
  by_place: dict[str, float] = {}
  cost = cost_model.simulate(nodes, H100, one_second, exposed_at=by_place)
  # Nothing computes beside them: each collective is waited for whole, every trip.
  assert by_place == {
    "all-gather in step": 1.0,
    "reduce-scatter in pipeline_drain": 3.0,
    "reduce-scatter in loop": 2.0,
  }
  assert sum(by_place.values()) == cost.exposed_comm_s == 6.0


def test_memory_bound_time_is_the_part_of_compute_that_hbm_sets():
  text = """HloModule m, is_scheduled=true

ENTRY %main (a: bf16[8192,8192], b: bf16[8192,8192]) -> bf16[8192,8192] {
  %a = bf16[8192,8192]{1,0} parameter(0)
  %b = bf16[8192,8192]{1,0} parameter(1)
  %d = bf16[8192,8192]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}
  ROOT %e = bf16[8192,8192]{1,0} add(%d, %a), metadata={op_name="jit(f)/add"}
}
"""
  program = hlo.analyze(text)
  dot, add = program.entry
  assert (dot.op_name, add.op_name) == ("jit(f)/dot_general", "jit(f)/add")
  cost = cost_model.simulate(program.entry, H100, lambda n: 0.0)
  dot_s = 2 * 8192**3 / (H100.achievable_tflops("bf16") * 1e12)
  add_s = 3 * 8192**2 * 2 / (H100.hbm_achievable_tb_s * 1e12)  # two reads, one write
  assert cost.compute_s == pytest.approx(dot_s + add_s)
  assert cost.memory_bound_s == pytest.approx(add_s)


def test_collectives_are_named_by_the_mesh_axes_they_run_along():
  # Compiled mesh data 2 x fsdp 1 x tensor 2 x pipeline 2: partition 4 d + 2 t + p.
  reduced = layout.ReducedMesh(
    None, {"data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2, "pipeline": 2}, 8, 1, 1
  )
  tensor = ((0, 2), (1, 3), (4, 6), (5, 7))
  assert layout.axes_of(tensor, reduced) == "tensor"
  assert layout.axes_of(((0, 4), (1, 5), (2, 6), (3, 7)), reduced) == "data"
  assert layout.axes_of(((0, 1), (1, 0), (2, 3), (3, 2)), reduced) == "pipeline"
  assert layout.axes_of(((0, 1, 2, 3), (4, 5, 6, 7)), reduced) == "tensor+pipeline"
  assert layout.axes_of(((0,), (1,)), reduced) == "none"
  # A sync tensor all-reduce (1 s, exposed), an async data all-reduce (1 s) behind 1 s of
  # compute (hidden), a sync permute along pipeline (0.5 s, exposed).
  work = hlo.Compute("w", "fusion", 0.0, 0.0, int(H100.hbm_achievable_tb_s * 1e12), 0, "bf16")
  nodes = (
    hlo.Collective("t", "all-reduce", 1, "bf16", tensor),
    hlo.Collective("d", "all-reduce", 1, "bf16", ((0, 4), (1, 5), (2, 6), (3, 7)), is_async=True),
    work,
    hlo.AsyncDone("d-done", "d"),
    hlo.Collective("p", "collective-permute", 1, "bf16", pairs=((0, 1), (1, 0))),
  )
  seconds = {"t": 1.0, "d": 1.0, "p": 0.5}
  by_axis = collective_timing.exposed_comm_by_axis_s(
    hlo.Program("p", 8, nodes), H100, reduced, lambda n: seconds[n.name]
  )
  assert by_axis == pytest.approx({"tensor": 1.0, "data": 0.0, "pipeline": 0.5}, abs=1e-9)


# ----------------------------------------------------------------------------- launch.py
# (hardware, gpus) -> what the one line launch.py prints must contain.
BAD_INPUT = {
  "unknown hardware": (("tpu9", "512"), "known: a100, h100, h200, b200, gb200, gb300, host"),
  "part of a node": (
    ("h100", "516"),
    "--gpus 516 on h100: --gpus 516 is not a whole number of 8-GPU nodes",
  ),
  "model-parallel": (("h100", "72"), "the other axes (64) do not divide the 72 devices"),
  "global batch": (
    ("h100", "640"),
    "train.global_batch = 1536 does not divide over the 80 data x fsdp x expert replicas of 640 GPUs",
  ),
  "not a number": (("h100", "5l2"), "--gpus takes positive whole numbers, got '5l2'"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_projection_input_is_one_line_before_anything_is_written(case, tmp_path):
  # As launch.py runs project mode (its flags as Options): each refusal raised before the
  # first compile, in one line, with nothing appended. The test below runs one through
  # launch.py, whose handler prints any mode's UserInputError so and exits 2.
  (hardware, gpus), message = BAD_INPUT[case]
  options = options_lib.Options(
    experiment="gpt3", mode="project", hardware=(hardware,), gpus=(gpus,), output_dir=str(tmp_path)
  )
  options_lib.check_paths(options)
  with pytest.raises(UserInputError) as refused:
    project_mode.run(options)
  assert message in str(refused.value) and "\n" not in str(refused.value)
  assert not (tmp_path / "results.jsonl").exists()


def test_bad_projection_input_through_launch_is_one_line_and_exit_2(tmp_path):
  (hardware, gpus), message = BAD_INPUT["global batch"]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  flags = ["--mode=project", "--experiment=gpt3", f"--hardware={hardware}", f"--gpus={gpus}"]
  command = [sys.executable, "launch.py", *flags, f"--output_dir={tmp_path}"]
  out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
  assert message in lines[0]
  assert not (tmp_path / "results.jsonl").exists()
