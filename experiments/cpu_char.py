"""CPU benchmark: nanoGPT's Shakespeare-character model shape, one device, float32."""

from experiments import ExperimentConfig
from model.config import ModelConfig
from parallelism.mesh import MeshConfig
from train.config import TrainConfig


def get_config() -> ExperimentConfig:
  return ExperimentConfig(
    name="cpu_char",
    description="6 layers, 6 heads, d_model 384, context 256, vocabulary 65",
    model=ModelConfig(
      name="cpu_char",
      num_layers=6,
      d_model=384,
      num_heads=6,
      head_dim=64,
      seq_len=256,
      vocab_size=65,
    ),
    mesh=MeshConfig(data=-1),
    train=TrainConfig(global_batch=16, steps=10, learning_rate=1e-3),
  )
