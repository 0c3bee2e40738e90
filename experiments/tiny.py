"""The default: a 2-layer GPT small enough to train in seconds on 8 CPU devices.

Data x fsdp x tensor = 2 x 2 x 2, so every kind of sharding and both networks
(tensor and fsdp inside a node, data across the 2 emulated nodes) are exercised.
"""

from experiments import ExperimentConfig
from model.config import ModelConfig
from parallelism.mesh import MeshConfig
from train.config import TrainConfig


def get_config() -> ExperimentConfig:
  return ExperimentConfig(
    name="tiny",
    description="2-layer GPT, d_model 64, on data x fsdp x tensor",
    model=ModelConfig(),
    mesh=MeshConfig(data=-1, fsdp=2, tensor=2),
    train=TrainConfig(global_batch=16, steps=10, task="learnable", learning_rate=3e-3),
  )
