"""The sharded train step on 8 CPU devices against the same step on one device."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from errors import UserInputError
from model.config import ModelConfig
from parallelism.mesh import MeshConfig, build_mesh, plan
from train import data, loop
from train import step as train_step
from train.config import TrainConfig

MODEL = ModelConfig(num_layers=2, d_model=64, num_heads=4, head_dim=16, seq_len=32, vocab_size=200)
TRAIN = TrainConfig(
  global_batch=8, steps=3, warmup_steps=0, task="learnable", learning_rate=1e-2, lr_warmup_steps=1
)
# float32 throughout; sharded reductions sum in a different order than one device, a
# relative 1e-7 per sum of at most a few hundred terms. Adam steps carry that into the
# parameters (O(1e-2) updates, normalised per entry by the gradient's size): rtol for the
# entries, atol for those a warm-up-sized update leaves near zero.
RTOL, ATOL = 2e-4, 2e-5


def _program(mesh_cfg: MeshConfig, devices: int, model=MODEL, train=TRAIN):
  layout = plan(mesh_cfg, devices)
  return train_step.build(model, train, build_mesh(layout, jax.devices()[:devices]))


def _train(program, steps: int):
  state, losses = program.init(), []
  for i in range(steps):
    batch = data.batch(
      TRAIN.task, TRAIN.seed, i, TRAIN.global_batch, MODEL.seq_len, MODEL.vocab_size
    )
    state, metrics = program.step(state, jax.device_put(batch, program.batch_sharding))
    losses.append(float(metrics["loss"]))
  return losses, jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def single_device():
  return _train(_program(MeshConfig(data=1), 1), steps=3)


@pytest.mark.parametrize(
  "mesh_cfg, micro_batch, shard_optimizer",
  [
    (MeshConfig(data=8, fsdp=1, tensor=1), 0, False),
    (MeshConfig(data=1, fsdp=8, tensor=1), 0, False),
    (MeshConfig(data=2, fsdp=1, tensor=4), 0, True),
    (MeshConfig(data=2, fsdp=2, tensor=2), 1, False),
  ],
  ids=["data8", "fsdp8", "data2-tensor4-sharded-optimizer", "2x2x2-micro-batches"],
)
def test_sharded_step_matches_one_device(mesh_cfg, micro_batch, shard_optimizer, single_device):
  losses_1, params_1 = single_device
  train = dataclasses.replace(TRAIN, micro_batch=micro_batch, shard_optimizer=shard_optimizer)
  losses_8, params_8 = _train(_program(mesh_cfg, 8, train=train), steps=3)
  np.testing.assert_allclose(losses_8, losses_1, rtol=RTOL)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), params_8, params_1
  )


def test_compiled_step_keeps_the_rule_shardings():
  program = _program(MeshConfig(data=2, fsdp=2, tensor=2), 8)
  compiled = program.lower(TRAIN.global_batch, MODEL.seq_len).compile()
  state_out, _ = compiled.output_shardings
  state_in, batch_in = compiled.input_shardings[0]
  for state in (state_in, state_out):
    assert state.params["layers"]["qkv_kernel"].spec == P(None, "fsdp", None, "tensor", None)
    assert state.params["layers"]["fc2_kernel"].spec == P(None, "tensor", "fsdp")
    assert state.params["wte"].spec == P("tensor", "fsdp")
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    assert adam.mu["layers"]["fc1_kernel"].spec == P(None, "fsdp", "tensor")
    assert adam.nu["wte"].spec == P("tensor", "fsdp")
  assert batch_in["inputs"].spec == P(("data", "fsdp", "expert"), None)


def test_sharded_optimizer_splits_each_moment_over_data_along_its_largest_dimension():
  train = dataclasses.replace(TRAIN, shard_optimizer=True)
  program = _program(MeshConfig(data=2, fsdp=2, tensor=2), 8, train=train)
  adam = program.abstract_state.opt_state[1][0]
  # fc1 [L, D, 4D]: D / fsdp = 32 and 4D / tensor = 128 rows per device; the larger splits.
  assert adam.mu["layers"]["fc1_kernel"].sharding.spec == P(None, "fsdp", ("tensor", "data"))
  assert adam.nu["wte"].sharding.spec == P(("tensor", "data"), "fsdp")
  assert program.abstract_state.params["layers"]["fc1_kernel"].sharding.spec == P(
    None, "fsdp", "tensor"
  )


def test_loss_falls_on_the_learnable_task():
  train = dataclasses.replace(TRAIN, steps=40, learning_rate=1e-2, lr_warmup_steps=5)
  program = _program(MeshConfig(data=2, fsdp=2, tensor=2), 8, train=train)
  result = loop.run(program, MODEL, train)
  assert len(result.step_times_s) == 40
  first, last = np.mean(result.losses[:3]), np.mean(result.losses[-3:])
  assert last < 0.6 * first, (first, last)


def test_training_is_deterministic_for_a_seed():
  program = _program(MeshConfig(data=2, fsdp=2, tensor=2), 8)
  assert _train(program, 2)[0] == _train(program, 2)[0]


def test_batch_must_divide_over_data_parallel_axes():
  with pytest.raises(
    UserInputError, match="train.global_batch = 6 does not divide over mesh data x fsdp = 4"
  ):
    _program(
      MeshConfig(data=2, fsdp=2, tensor=2), 8, train=dataclasses.replace(TRAIN, global_batch=6)
    )


def test_heads_must_divide_over_tensor():
  model = dataclasses.replace(MODEL, num_heads=2, head_dim=32)
  with pytest.raises(
    UserInputError, match="model.num_heads = 2 does not divide over mesh tensor = 4"
  ):
    _program(MeshConfig(data=2, fsdp=1, tensor=4), 8, model=model)
