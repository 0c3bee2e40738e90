"""The composed projection (projection/compose.py) against the full compile, on a toy
pipelined GPT deviceless on H100, and its disk cache of compiled pieces."""

import dataclasses

import pytest
from projected import projected

from errors import UserInputError
from parallelism.mesh import MeshConfig
from projection import aot_compile, compose, disk_cache, targets
from train.config import TrainConfig

_CUDA, _WHY = targets.cuda_available()


@pytest.fixture(scope="module")
def toy(toy_experiment):
  """8 layers in 2 stages x 4 virtual stages (one-layer chunks), tensor 2, 8 micro-batches
  a replica on 64 H100 (data 16): the pieces have 2 or 3 virtual stages and 6 or 8
  micro-batches, so the target is an extrapolation in V."""
  return toy_experiment(
    "compose_toy",
    mesh=MeshConfig(data=-1, tensor=2, pipeline=2),
    train=TrainConfig(
      global_batch=128,
      micro_batch=1,
      pipeline_schedule="1f1b",
      virtual_stages=4,
      shard_optimizer=True,
    ),
    shape="wide",
    num_layers=8,
    param_dtype="bfloat16",
  )


@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
def test_composed_matches_the_full_compile_and_hits_its_cache(toy, tmp_path, monkeypatch):
  monkeypatch.setenv(compose.CACHE_ENV, str(tmp_path))
  composed = projected(toy, "h100", 64, "composed")
  reference = projected(toy, "h100", 64)
  assert composed["composition"]["cached"] is False
  assert composed["micro_batches"] == reference["micro_batches"] == 8
  # The target runs the first piece's loop bodies at its own trip counts; what differs is
  # what is extrapolated linearly in V and M around the loops (per-stage state and its
  # update, embedding and head) and how XLA schedules those in programs of other sizes:
  # the targets, 3% on step time and 5% on memory (-0.6% and +1.3% here).
  assert composed["step_time_s"] == pytest.approx(reference["step_time_s"], rel=0.03)
  assert composed["memory_per_gpu_gb"] == pytest.approx(reference["memory_per_gpu_gb"], rel=0.05)
  # The bubble is (P - 1) fill and drain trips of loop bodies that XLA compiles the same in
  # the piece and in the whole step: equal up to float rounding.
  assert composed["breakdown"]["bubble_s"] == pytest.approx(reference["breakdown"]["bubble_s"])
  # Exposed time by collective and place is extrapolated like exposed_comm_s, key by key:
  # the parts add up to it (float rounding).
  for point in (composed, reference):
    parts = point["breakdown"]["exposed_comm_by_place_s"]
    assert sum(parts.values()) == pytest.approx(point["breakdown"]["exposed_comm_s"])

  # The second time the pieces come from disk: nothing is compiled.
  def no_compile(*args, **kwargs):
    raise AssertionError("a cached piece was compiled again")

  monkeypatch.setattr(aot_compile, "compiled_program", no_compile)
  again = projected(toy, "h100", 64, "composed")
  assert again["composition"]["cached"] is True
  assert again["step_time_s"] == composed["step_time_s"]  # same pieces, same arithmetic

  # Pieces compiled by other code are not read back: another code digest compiles anew.
  monkeypatch.setattr(disk_cache, "code_digest", lambda: "other code")
  with pytest.raises(AssertionError, match="compiled again"):
    projected(toy, "h100", 64, "composed")


def test_lockstep_schedules_are_not_composed(toy):
  lockstep = dataclasses.replace(
    toy, train=dataclasses.replace(toy.train, pipeline_schedule="interleaved")
  )
  with pytest.raises(UserInputError, match="1f1b"):
    projected(lockstep, "h100", 64, "composed")
