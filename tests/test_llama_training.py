"""A tiny Llama (llama3-tiny: grouped-query attention, rotary positions, SwiGLU) trains on
the token corpus with context and tensor parallelism, checkpoints, and resumes.

In-process on 4 CPU devices (context 2 x tensor 2: each sequence's two slabs mapped apart,
parallelism/gradients.py). The resumed run executes the same compiled program on the same
devices from a state restored byte for byte, on the corpus batches of the same steps
(a pure function of the seed and the step), so its states equal the uninterrupted run's
bit for bit.
"""

import os
import shutil

import jax
import numpy as np
import pytest
import small_models

import experiments
from experiments import overrides
from tools import make_tokens
from train import loop
from train.checkpoint import Checkpoints

STEPS, EVERY = 10, 5


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
  corpus = str(tmp_path_factory.mktemp("corpus") / "python_docs.bin")
  make_tokens.make(make_tokens.PYTHON_DOCS, corpus)
  return overrides.apply(
    experiments.load("tiny"),
    [
      "model=llama3-tiny",
      "model.num_layers=2",
      "train.task=tokens",
      f"train.data_path={corpus}",
      f"train.steps={STEPS}",
      "train.warmup_steps=0",
      "mesh.fsdp=1",
      "mesh.tensor=2",
      "mesh.context=2",
    ],
  )


@pytest.fixture(scope="module")
def program(exp):
  return small_models.train_program(exp, 4)


@pytest.fixture(scope="module")
def uninterrupted(exp, program, tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("ckpt"))
  return directory, loop.run(program, exp.model, exp.train, Checkpoints(directory, EVERY, 3))


def test_loss_falls_on_the_token_corpus(exp, program, uninterrupted):
  assert dict(program.mesh.shape)["context"] == 2 and exp.model.num_kv_heads == 2
  losses = uninterrupted[1].losses
  assert len(losses) == STEPS
  # Uniform over 256 bytes is ln 256 = 5.55; byte frequencies alone bring it under 4.5.
  assert losses[0] > 5.0 and losses[-1] < losses[0] - 0.8, losses


def test_resumes_from_a_checkpoint_bit_for_bit(exp, program, uninterrupted, tmp_path):
  directory, reference = uninterrupted
  shutil.copytree(os.path.join(directory, str(EVERY)), tmp_path / str(EVERY))
  resumed = loop.run(program, exp.model, exp.train, Checkpoints(str(tmp_path), EVERY, 3))
  assert resumed.first_step == EVERY
  assert resumed.losses == reference.losses[EVERY:]
  for a, b in zip(
    jax.tree.leaves(resumed.final_state), jax.tree.leaves(reference.final_state), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
