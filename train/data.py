"""Token batches, deterministic in (seed, step).

synthetic: uniform random tokens, for timing (the loss cannot fall).
learnable: arithmetic sequences modulo the vocabulary - each row starts at a random
token and steps by a random stride from a small set - so the next token is a function
of the previous two and the loss falls quickly; used by tests to show learning.
"""

import numpy as np

_STRIDES = (1, 2, 3, 5)


def batch(
  task: str, seed: int, step: int, global_batch: int, seq_len: int, vocab_size: int
) -> dict[str, np.ndarray]:
  """{'inputs', 'targets'}: int32 [global_batch, seq_len], targets shifted by one."""
  rng = np.random.default_rng([seed, step])
  if task == "synthetic":
    tokens = rng.integers(0, vocab_size, (global_batch, seq_len + 1))
  else:
    start = rng.integers(0, vocab_size, (global_batch, 1))
    stride = rng.choice(_STRIDES, (global_batch, 1))
    tokens = (start + stride * np.arange(seq_len + 1)) % vocab_size
  tokens = tokens.astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
