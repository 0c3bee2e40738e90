"""The Llama 3 family (Meta, arXiv:2407.21783), 8B by default; `--set model=llama3.1-70b` etc.

Sizes: llama3.1-8b, llama3.1-70b, llama3.1-405b, llama3.2-1b, llama3.2-3b and
llama3-tiny (the architecture at test size, for CPU runs); model/presets.py holds their
shapes. Sequences of 8,192 tokens, Llama 3's pre-training context. The recipe is the one
Meta publishes for its 7B Llama 2 (Touvron et al. 2023, arXiv:2307.09288, section 2.2
and Table 1): AdamW with beta2 0.95, eps 1e-5, weight decay 0.1, gradient clip 1.0, peak
learning rate 3e-4 after 2,000 warm-up steps, cosine decay to 10%, and 4M-token batches
(512 x 8,192). Llama 3 405B's own (section 3.4.1: peak 8e-5, 8,000 warm-up steps,
decay to 8e-7) is `--set train.learning_rate=8e-5 --set train.lr_warmup_steps=8000
--set train.min_lr_ratio=0.01`. The mesh shards the model with FSDP over 8 devices and
data parallelism over the rest; the large sizes need tensor and pipeline parallelism
too (`--set tensor_parallel=8 --set pipeline_parallel=...`).
"""

import dataclasses

from experiments import ExperimentConfig
from model.presets import preset
from parallelism.mesh import MeshConfig
from train.config import TrainConfig


def get_config() -> ExperimentConfig:
  return ExperimentConfig(
    name="llama3",
    description="Llama 3 family (3.1 8B by default), bf16 compute, full remat",
    model=dataclasses.replace(preset("llama3.1-8b"), remat="full"),
    mesh=MeshConfig(data=-1, fsdp=8),
    train=TrainConfig(
      global_batch=512,
      micro_batch=1,
      steps=10,
      learning_rate=3e-4,
      lr_warmup_steps=2000,
      lr_decay_steps=100000,
      eps=1e-5,
    ),
  )
