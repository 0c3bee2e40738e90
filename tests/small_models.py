"""Model shapes the CPU tests share: small enough to compile in seconds on 8 host devices,
with every feature of the architecture they stand for; and the train program of an
experiment on the first N of them."""

import dataclasses

import jax

from experiments import ExperimentConfig
from model.presets import preset
from parallelism import mesh as mesh_lib
from train import step as train_step

# llama3-tiny's architecture, smaller: 4 query heads sharing 2 K/V heads of 8, rotary
# positions, SwiGLU; T = 16 and D = 32 make activation shapes recognisable in the HLO.
SMALL_LLAMA = dataclasses.replace(
  preset("llama3-tiny"), d_model=32, head_dim=8, ffn_dim=64, seq_len=16, vocab_size=128
)


def train_program(exp: ExperimentConfig, devices: int) -> train_step.TrainProgram:
  """exp's train program on the first `devices` host devices, laid out as launch.py would."""
  layout = mesh_lib.plan(exp.mesh, devices)
  return train_step.build(
    exp.model, exp.train, mesh_lib.build_mesh(layout, jax.devices()[:devices])
  )
