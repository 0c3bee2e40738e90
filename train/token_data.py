"""Real token files and the Grain dataset that reads them.

A token file is a flat binary of uint16 token ids with no header, the layout of nanoGPT's
train.bin, so such files can be used as they are. A JSON file beside it (`NAME.bin.json`)
names the tokenizer and its vocabulary size, which is checked against the model's.

The tokenizer here is byte-level: a token is one byte of the UTF-8 text. It needs no
vocabulary file and no download, is lossless for any text, and its 256 ids fit the
model's default vocabulary; the price is about 4x more tokens than a BPE would give.

Records are windows of seq_len + 1 tokens (inputs and the targets shifted by one) at a
stride of seq_len. Grain shuffles them with a seed, afresh each epoch; the record index
of a batch row is a pure function of (seed, step, row), so any process can read exactly
the rows it holds and nothing else.
"""

from __future__ import annotations  # grain.IterDataset stays unevaluated: grain is optional

import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from errors import UserInputError

if TYPE_CHECKING:  # grain is imported where it is used: a GPU image may lack it
  import grain

TOKEN_DTYPE = np.uint16
BYTE_VOCAB_SIZE = 256


def encode_bytes(text: str) -> np.ndarray:
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(TOKEN_DTYPE)


def write(path: str, tokens: np.ndarray, vocab_size: int, tokenizer: str) -> None:
  """Write the token file and its JSON description."""
  if tokens.size and int(tokens.max()) >= vocab_size:
    raise ValueError(f"token id {int(tokens.max())} is outside the vocabulary of {vocab_size}")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  # Each file is written beside its final name and renamed into place, so a kill leaves
  # the old file or the new one, never half of one (and a mismatched pair is refused by
  # `check_file`: the description counts the tokens).
  tokens.astype(TOKEN_DTYPE).tofile(f"{path}.partial")
  with open(f"{path}.json.partial", "w") as f:
    json.dump(
      {
        "dtype": "uint16",
        "vocab_size": vocab_size,
        "tokenizer": tokenizer,
        "tokens": int(tokens.size),
      },
      f,
      indent=2,
    )
  os.replace(f"{path}.partial", path)
  os.replace(f"{path}.json.partial", f"{path}.json")


def _description(path: str, tokens: int) -> dict | None:
  """The JSON beside a token file (None: there is none), checked against the file."""
  meta_path = f"{path}.json"
  if not os.path.exists(meta_path):
    return None
  try:
    with open(meta_path, encoding="utf-8") as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise UserInputError(
      f"train.data_path: {meta_path} cannot be read as JSON ({type(e).__name__}; a partial "
      f"write?); remake the file with tools/make_tokens.py or delete the .json"
    ) from None
  vocab_size = meta.get("vocab_size") if isinstance(meta, dict) else None
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
    raise UserInputError(f"train.data_path: {meta_path} has no positive whole vocab_size")
  if meta.get("dtype", "uint16") != "uint16":
    raise UserInputError(
      f"train.data_path: {meta_path} says dtype {meta['dtype']!r}; token files are uint16"
    )
  if "tokens" in meta and meta["tokens"] != tokens:
    raise UserInputError(
      f"train.data_path: {meta_path} says {meta['tokens']} tokens, {path} "
      f"holds {tokens} (an incomplete write?)"
    )
  return meta


def check_file(path: str, model_vocab_size: int) -> np.ndarray:
  """The token file's ids, memory-mapped, once it is known to be usable by the model:
  a regular file of whole uint16 ids, all below `model_vocab_size`, agreeing with its
  JSON description. A bad file is refused by name (an id beyond the vocabulary would
  otherwise index past the embedding and give NaN at the first step)."""
  if os.path.isdir(path):
    raise UserInputError(f"train.data_path: {path} is a directory, not a token file")
  if not os.path.isfile(path):
    raise UserInputError(
      f"train.data_path: no token file at {path!r} (make one with tools/make_tokens.py)"
    )
  size = os.path.getsize(path)
  if size == 0:
    raise UserInputError(f"train.data_path: {path} is empty")
  if size % np.dtype(TOKEN_DTYPE).itemsize:
    raise UserInputError(
      f"train.data_path: {path} has {size:,} bytes, not a whole number of "
      f"2-byte uint16 ids (truncated, or not a token file)"
    )
  meta = _description(path, size // np.dtype(TOKEN_DTYPE).itemsize)
  if meta is not None and meta["vocab_size"] > model_vocab_size:
    raise UserInputError(
      f"model.vocab_size = {model_vocab_size} is smaller than the "
      f"{meta['vocab_size']} ids of the token file {path}"
    )
  try:
    tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    largest = int(tokens.max())
  except OSError as e:
    raise UserInputError(f"train.data_path: {path} cannot be read ({e.strerror})") from None
  if largest >= model_vocab_size:
    position = int(np.argmax(tokens >= model_vocab_size))
    raise UserInputError(
      f"train.data_path: {path} holds token id {largest} (first beyond "
      f"the vocabulary at position {position:,}), outside model.vocab_size "
      f"= {model_vocab_size}"
    )
  return tokens


class TokenWindows:
  """Grain random-access source: record i is tokens[i * seq_len : i * seq_len + seq_len + 1]."""

  def __init__(self, path: str, seq_len: int, model_vocab_size: int):
    self._tokens = check_file(path, model_vocab_size)
    self._seq_len = seq_len
    self._windows = (len(self._tokens) - 1) // seq_len
    if self._windows < 1:
      raise UserInputError(
        f"train.data_path: {path} holds {len(self._tokens)} tokens, fewer "
        f"than one sequence of model.seq_len + 1 = {seq_len + 1}"
      )

  def __len__(self) -> int:
    return self._windows

  def __getitem__(self, index: int) -> np.ndarray:
    start = index * self._seq_len
    return np.asarray(self._tokens[start : start + self._seq_len + 1], dtype=np.int32)


def local_batches(
  path: str, seq_len: int, model_vocab_size: int, seed: int, global_batch: int, rows: Sequence[int]
) -> grain.IterDataset:
  """This process's rows of every global batch, one [len(rows), seq_len + 1] array per step.

  Row r of step s is record s * global_batch + r of the shuffled, endlessly repeated
  windows, whichever process reads it; only the listed rows are read.
  """
  # Imported here: only token files need grain, and GPU images may lack it.
  import grain  # pylint: disable=import-outside-toplevel

  records = grain.MapDataset.source(TokenWindows(path, seq_len, model_vocab_size))
  records = records.shuffle(seed=seed).repeat()
  rows = list(rows)
  per_step = len(rows)
  # One element per (step, local row), in order; the map reads the record it stands for.
  local = grain.MapDataset.range(sys.maxsize).map(
    lambda i: records[(i // per_step) * global_batch + rows[i % per_step]]
  )
  # Reading is a memory-mapped slice per row: one thread keeps the cores for XLA.
  return local.batch(per_step, drop_remainder=True).to_iter_dataset(
    grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
  )
