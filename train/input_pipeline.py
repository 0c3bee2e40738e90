"""Each step's global token batch, assembled from the rows this process holds.

A process reads (or generates) only the batch rows that its devices hold under the
batch sharding and hands them to `jax.make_array_from_process_local_data`; the global
batch is the same whatever the number of processes, so 2 processes x 4 devices train
on exactly what 1 process x 8 devices does.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding

from model.config import ModelConfig
from train import data, token_data
from train.config import TrainConfig


def local_rows(sharding: NamedSharding, global_batch: int, seq_len: int) -> list[int]:
  """The global batch rows that this process's devices hold, in order."""
  rows = set()
  for index in sharding.addressable_devices_indices_map((global_batch, seq_len)).values():
    rows.update(range(*index[0].indices(global_batch)))
  return sorted(rows)


class BatchSource:
  """Batches for the configured task; `iterator` is the state to checkpoint (None when the
  batch is a pure function of the step)."""

  def __init__(self, train_cfg: TrainConfig, model_cfg: ModelConfig, sharding: NamedSharding):
    self._cfg = train_cfg
    self._seq_len = model_cfg.seq_len
    self._vocab_size = model_cfg.vocab_size
    self._sharding = sharding
    self._rows = local_rows(sharding, train_cfg.global_batch, model_cfg.seq_len)
    self.iterator = None
    if train_cfg.task == "tokens":
      self.iterator = iter(
        token_data.local_batches(
          train_cfg.data_path,
          model_cfg.seq_len,
          model_cfg.vocab_size,
          train_cfg.seed,
          train_cfg.global_batch,
          self._rows,
        )
      )

  def batch(self, step: int) -> dict[str, jax.Array]:
    """The batch of `step` (token files: the iterator's next, which is that step's)."""
    if self.iterator is not None:
      tokens = next(self.iterator)
      local = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    else:
      full = data.batch(
        self._cfg.task,
        self._cfg.seed,
        step,
        self._cfg.global_batch,
        self._seq_len,
        self._vocab_size,
      )
      local = {k: v[self._rows] for k, v in full.items()}
    shape = (self._cfg.global_batch, self._seq_len)
    return {
      k: jax.make_array_from_process_local_data(self._sharding, np.ascontiguousarray(v), shape)
      for k, v in local.items()
    }
