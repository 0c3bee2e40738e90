"""CPU benchmark: GPT-2 small (124M) at context 256, one device, float32."""

from experiments import ExperimentConfig
from model.config import ModelConfig
from parallelism.mesh import MeshConfig
from train.config import TrainConfig


def get_config() -> ExperimentConfig:
  return ExperimentConfig(
    name="cpu_gpt2_small",
    description="12 layers, 12 heads, d_model 768, context 256, vocabulary 50,304",
    model=ModelConfig(
      name="cpu_gpt2_small",
      num_layers=12,
      d_model=768,
      num_heads=12,
      head_dim=64,
      seq_len=256,
      vocab_size=50304,
    ),
    mesh=MeshConfig(data=-1),
    train=TrainConfig(global_batch=4, steps=5, learning_rate=6e-4),
  )
