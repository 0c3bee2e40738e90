"""Make a token file (flat uint16 ids, nanoGPT's train.bin layout) from text, offline.

  python tools/make_tokens.py --input=notes.txt --output=data/notes.bin
  python tools/make_tokens.py --input=python-docs --output=data/python_docs.bin

The tokenizer is byte-level (train/token_data.py says why). `--input=python-docs` takes
the documentation topics that ship with Python's standard library (`pydoc_data`, about
470 KB of English prose and code): a real corpus present wherever Python is, used by
the tests, with nothing downloaded.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from absl import app, flags

from train import token_data

PYTHON_DOCS = "python-docs"

_INPUT = flags.DEFINE_string("input", None, f"A UTF-8 text file, or {PYTHON_DOCS}.", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "The token file to write.", required=True)


def python_docs_text() -> str:
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel

  return "\n\n".join(topics.topics[name] for name in sorted(topics.topics))


def make(input_name: str, output: str) -> int:
  """Write `output` from `input_name`; returns the number of tokens."""
  if input_name == PYTHON_DOCS:
    text = python_docs_text()
  else:
    with open(input_name, encoding="utf-8") as f:
      text = f.read()
  tokens = token_data.encode_bytes(text)
  token_data.write(output, tokens, token_data.BYTE_VOCAB_SIZE, "bytes (UTF-8)")
  return len(tokens)


def main(argv: list[str]) -> None:
  del argv
  count = make(_INPUT.value, _OUTPUT.value)
  print(
    f"{count:,} tokens (byte-level, vocabulary {token_data.BYTE_VOCAB_SIZE}) -> {_OUTPUT.value}"
  )


if __name__ == "__main__":
  app.run(main)
