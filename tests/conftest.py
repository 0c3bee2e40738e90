"""Tests run on 8 host CPU devices, configured before anything imports jax.

Compiled programs are cached for the session in a fresh directory, shared with the
launch.py subprocesses the tests start and with the other xdist workers (they inherit the
environment of the process that made it): many tests compile the same small programs again
(a checkpoint resumed, a run repeated on other processes, the same step in two modules), and
the suite must stay under 10 minutes on 2 cores. A fresh directory each session keeps one
run's compiles from standing in for the next's.

Host CPU programs compile without LLVM's optimizations (jax_disable_most_optimizations;
the launch.py subprocesses inherit it): the optimized HLO, its fusions, schedule and buffers
are the same, only the machine code is slower, and CPU compiles are most of the suite's
time (test_train.py runs in half the time). Results can differ in their last bits, below
every tolerance here; runs compared bit for bit are compiled alike.
Tests that time host steps against a projection opt back in (`optimized_host_code`).
Host programs also compile with XLA:CPU's loop emitters instead of its MLIR fusion
emitters (--xla_cpu_use_fusion_emitters=false, in XLA_FLAGS so the subprocesses inherit
it): a fusion's code is emitted another way, the HLO around it is XLA's own either way,
and a pipelined MoE step compiles in half the time (79 -> 43 s for three test_moe.py
tests). It is process-wide, so the opted-back-in tests run with it too.
Deviceless GPU compiles already use these settings (projection/aot_compile.py FAST_BACKEND).

Under `pytest -n N` the tests of a module run on one worker (`pytest_xdist_make_scheduler`
below): they share module-scoped fixtures (a training run, a batch of launch.py runs) and
in-process compiles (projection/aot_compile.py's compile_step), which every worker that
ran one of them would build again.
"""

import atexit
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # =0 to test optimized code
# Set by the process that made the cache directory; an xdist worker keeps its controller's.
_CACHE_OWNER = "JAX_SCALING_TESTS_CACHE_DIR"
if "PYTEST_XDIST_WORKER" in os.environ and _CACHE_OWNER in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_CACHE_OWNER]
else:
  os.environ[_CACHE_OWNER] = tempfile.mkdtemp(prefix="jax-scaling-tests-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_CACHE_OWNER]
  atexit.register(shutil.rmtree, os.environ[_CACHE_OWNER], ignore_errors=True)

# Deviceless compiles are not kept on disk (projection/aot_compile.py): a test that patches
# what a compile reads must not leave its program for another test, or for the user's runs.
os.environ["JAX_SCALING_COMPILE_CACHE"] = "off"

_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_cpu_use_fusion_emitters" not in _FLAGS:
  os.environ["XLA_FLAGS"] = f"{_FLAGS} --xla_cpu_use_fusion_emitters=false".strip()

import platform_env  # noqa: E402

platform_env.configure(host_devices=8)

import pytest  # noqa: E402


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
  """`-n N` alone would hand out tests one by one (xdist's `load`); instead each module's
  tests go to one worker (`loadscope`), which would otherwise build the module's fixtures
  and compiles again. An explicit --dist stays as given."""
  explicit = any(a.startswith(("--dist", "-d")) for a in config.invocation_params.args)
  if config.getvalue("dist") != "load" or explicit:
    return None
  from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415 (only under xdist)

  return LoadScopeScheduling(config, log)


@pytest.fixture(scope="module")
def optimized_host_code():
  """Host programs compiled with LLVM's optimizations for a module, as launch.py compiles
  them: for steps whose measured time is the point. Programs compiled before are dropped
  from jax's in-memory caches, which do not key on the setting."""
  import jax  # noqa: PLC0415

  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  jax.clear_caches()
  yield
  jax.config.update("jax_disable_most_optimizations", before)
  jax.clear_caches()


# The toy experiment's shapes: "narrow" has 2 heads (tensor 4 and 8 do not divide them),
# "wide" 4 heads over 256 tokens (tensor 2 and 4 do).
TOY_SHAPES = {
  "narrow": dict(d_model=128, num_heads=2, seq_len=128, vocab_size=256),
  "wide": dict(d_model=256, num_heads=4, seq_len=256, vocab_size=512),
}


@pytest.fixture(scope="session")
def toy_experiment():
  """A factory of the tests' toy experiment: a 4-layer GPT of heads of 64 (TOY_SHAPES),
  bfloat16, 16 sequences a step, on one 8-GPU node data-parallel unless `mesh` says
  otherwise. The narrow one's 4 layers and 2 heads break tensor 4 and 8 and pipeline x
  virtual stages of 8 and up, so both the valid and the refused layouts are small.
  `model` fields override the model's."""
  import experiments  # noqa: PLC0415 (after the platform is configured above)
  from model.config import ModelConfig  # noqa: PLC0415
  from parallelism.mesh import MeshConfig  # noqa: PLC0415
  from train.config import TrainConfig  # noqa: PLC0415

  def make(
    name: str = "toy",
    mesh: MeshConfig | None = None,
    train: TrainConfig | None = None,
    shape: str = "narrow",
    **model,
  ) -> experiments.ExperimentConfig:
    fields = dict(
      name=name, num_layers=4, head_dim=64, compute_dtype="bfloat16", **TOY_SHAPES[shape]
    )
    return experiments.ExperimentConfig(
      name=name,
      description=f"{name}: the tests' toy experiment",
      model=ModelConfig(**{**fields, **model}),
      mesh=mesh or MeshConfig(data=-1),
      train=train or TrainConfig(global_batch=16),
    )

  return make
