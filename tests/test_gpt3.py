"""GPT-3 175B from abstract shapes: its size, and a train step that compiles on 64 devices."""

import math
import os
import subprocess
import sys
import textwrap

import jax
from flax import nnx

from model.flops import param_count
from model.gpt import GPT
from model.presets import preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_175b_parameter_count_from_abstract_shapes():
  cfg = preset("gpt3-175b")
  abstract = nnx.state(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))), nnx.Param)
  counted = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
  assert counted == param_count(cfg)
  # Brown et al. round to 175.0B; 0.5% is that rounding (the count itself is exact).
  assert abs(counted / 174.6e9 - 1) < 0.005, counted


def test_175b_step_compiles_on_a_64_device_mesh():
  # 64 host devices need their own process: XLA fixes the device count at start-up.
  # (The timeout only stops a hung compile; compile speed is benchmarks/' business.)
  script = textwrap.dedent("""
      import dataclasses
      import platform_env
      platform_env.configure(host_devices=64)
      from model.presets import preset
      from parallelism.mesh import MeshConfig, build_mesh, plan
      from train import step
      from train.config import TrainConfig
      layout = plan(MeshConfig(data=1, fsdp=8, tensor=8, devices_per_node=8), 64)
      model = dataclasses.replace(preset("gpt3-175b"), remat="full")
      program = step.build(model, TrainConfig(global_batch=64), build_mesh(layout))
      compiled = program.lower(64, 2048).compile()
      print("tensor_nvlink", layout.nvlink["tensor"])
      print("flops_positive", compiled.cost_analysis()["flops"] > 0)
  """)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  out = subprocess.run(
    [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stderr[-3000:]
  values = dict(line.split() for line in out.stdout.splitlines())
  assert values["tensor_nvlink"] == "8"
  assert values["flops_positive"] == "True"
