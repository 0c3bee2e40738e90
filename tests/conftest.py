"""Tests run on 8 host CPU devices, configured before anything imports jax.

Compiled programs are cached for the session in a fresh directory, shared with the
launch.py subprocesses the tests start (they inherit the environment): many tests compile
the same small programs again (a checkpoint resumed, a run repeated on other processes),
and the suite must stay under 10 minutes on 2 cores. A fresh directory each session keeps
one run's compiles from standing in for the next's.
"""

import atexit
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-scaling-tests-")
atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import platform_env  # noqa: E402

platform_env.configure(host_devices=8)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def toy_experiment():
  """A factory of the toy experiment the search and MLPerf tests lay out on one 8-GPU
  node: a 4-layer GPT of 2 heads of 64, 128 tokens, bfloat16, 16 sequences a step. 4
  layers and 2 heads break tensor 4 and 8 and pipeline x virtual stages of 8 and up, so
  both the valid and the refused layouts are small. `model` fields override the model's."""
  import experiments  # noqa: PLC0415 (after the platform is configured above)
  from model.config import ModelConfig  # noqa: PLC0415
  from parallelism.mesh import MeshConfig  # noqa: PLC0415
  from train.config import TrainConfig  # noqa: PLC0415

  def make(
    name: str = "toy", mesh: MeshConfig | None = None, train: TrainConfig | None = None, **model
  ) -> experiments.ExperimentConfig:
    fields = dict(
      name=name,
      num_layers=4,
      d_model=128,
      num_heads=2,
      head_dim=64,
      seq_len=128,
      vocab_size=256,
      compute_dtype="bfloat16",
    )
    return experiments.ExperimentConfig(
      name=name,
      description=f"{name}: the tests' toy experiment",
      model=ModelConfig(**{**fields, **model}),
      mesh=mesh or MeshConfig(data=-1),
      train=train or TrainConfig(global_batch=16),
    )

  return make
