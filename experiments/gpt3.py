"""The GPT-3 family (Brown et al. 2020), 175B by default; `--set model=gpt3-1.3b` etc.

The mesh keeps tensor parallelism inside the NVLink domain and shards the rest with
FSDP; batch 1,536 sequences of 2,048 tokens is the GPT-3 paper's 3.2M-token batch.
On a CPU-only machine train the small sizes (`--set model=gpt3-125m`); the large ones
are for GPU clusters and projection.
"""

import dataclasses

from experiments import ExperimentConfig
from model.presets import preset
from parallelism.mesh import MeshConfig
from train.config import TrainConfig


def get_config() -> ExperimentConfig:
  return ExperimentConfig(
    name="gpt3",
    description="GPT-3 family (175B by default), bf16 compute, full remat",
    model=dataclasses.replace(preset("gpt3-175b"), remat="full"),
    mesh=MeshConfig(data=-1, fsdp=8, tensor=8),
    train=TrainConfig(
      global_batch=1536,
      micro_batch=1,
      steps=10,
      learning_rate=6e-5,
      lr_warmup_steps=375,
      lr_decay_steps=10000,
    ),
  )
