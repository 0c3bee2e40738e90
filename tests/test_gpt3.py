"""GPT-3 175B from abstract shapes: its size. (Its train step compiles in the projections
of tests/test_projection.py and tests/test_calibration.py.)"""

import math

import jax
from flax import nnx

from model.flops import param_count
from model.gpt import GPT
from model.presets import preset


def test_175b_parameter_count_from_abstract_shapes():
  cfg = preset("gpt3-175b")
  abstract = nnx.state(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))), nnx.Param)
  counted = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
  assert counted == param_count(cfg)
  # Brown et al. round to 175.0B; 0.5% is that rounding (the count itself is exact).
  assert abs(counted / 174.6e9 - 1) < 0.005, counted
