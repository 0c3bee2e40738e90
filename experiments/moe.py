"""Mixtures of experts (model/moe.py): `moe-tiny` on 8 CPU devices by default.

Sizes (`--set model=NAME`, model/presets.py MOE_PRESETS): moe-tiny (3 layers, the first
dense; 8 experts, 2 a token, a shared one, sigmoid scores with bias balancing and
group-limited routing), mixtral-8x7b, qwen3-30b-a3b, deepseek-v3-671b. The mesh is
data x expert x tensor = 2 x 2 x 2: the experts split over `expert`, which is data-parallel
for attention and the dense layers, inside each emulated node with `tensor`. Capacity
factor 1 (`--set model.capacity_factor=0`: dropless) and the learnable task, so a run shows
the loss falling and the balancing at work (`expert_load_max_over_mean` in the metrics).
"""

import dataclasses

from experiments import ExperimentConfig
from model.presets import preset
from parallelism.mesh import MeshConfig
from train.config import TrainConfig


def get_config() -> ExperimentConfig:
  return ExperimentConfig(
    name="moe",
    description="mixture of experts (moe-tiny by default) on data x expert x tensor",
    model=dataclasses.replace(preset("moe-tiny"), capacity_factor=1.0),
    mesh=MeshConfig(data=-1, expert=2, tensor=2),
    train=TrainConfig(global_batch=16, steps=10, task="learnable", learning_rate=3e-3),
  )
