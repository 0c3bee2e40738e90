"""Make a token file (flat uint16 ids, nanoGPT's train.bin layout) from text, offline.

  python tools/make_tokens.py --input=notes.txt --output=data/notes.bin
  python tools/make_tokens.py --input=python-docs --output=data/python_docs.bin

The tokenizer is byte-level (train/token_data.py says why). `--input=python-docs` takes
the documentation topics that ship with Python's standard library (`pydoc_data`, about
470 KB of English prose and code): a real corpus present wherever Python is, used by
the tests, with nothing downloaded.

Bad input (a missing or non-UTF-8 input, an output that is the input, a directory or
unwritable) gets one line on stderr and exit code 2; the input is never written to.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
import platform_env

# Nothing here runs on a device; CPU only keeps the CUDA plugin's start-up logs away.
if not platform_env.has_nvidia_gpu():
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
with platform_env.captured_stderr():
  from absl import app, flags

  from errors import UserInputError
  from train import token_data

PYTHON_DOCS = "python-docs"

_INPUT = flags.DEFINE_string("input", None, f"A UTF-8 text file, or {PYTHON_DOCS}.", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "The token file to write.", required=True)


def python_docs_text() -> str:
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel

  return "\n\n".join(topics.topics[name] for name in sorted(topics.topics))


def _same_file(a: str, b: str) -> bool:
  if os.path.exists(a) and os.path.exists(b):
    return os.path.samefile(a, b)
  return os.path.realpath(a) == os.path.realpath(b)


def check(input_name: str, output: str) -> None:
  """Refuse what would fail or overwrite the input, before anything is written."""
  if not output.strip():
    raise UserInputError("--output: empty; name the token file to write")
  if input_name != PYTHON_DOCS:
    if not input_name.strip():
      raise UserInputError(f"--input: empty; name a UTF-8 text file or {PYTHON_DOCS}")
    if not os.path.isfile(input_name):
      what = "a directory" if os.path.isdir(input_name) else "no such file"
      raise UserInputError(f"--input {input_name}: {what}; name a UTF-8 text file or {PYTHON_DOCS}")
    for written in (output, f"{output}.json"):
      if _same_file(input_name, written):
        raise UserInputError(
          f"--output {output} would overwrite the input {input_name}; choose another output"
        )
  if os.path.isdir(output):
    raise UserInputError(f"--output {output} is a directory; name a file")
  parent = os.path.dirname(os.path.abspath(output))
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise UserInputError(f"--output {output}: {parent} is a file, not a directory")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise UserInputError(f"--output {output}: {parent} is not writable")


def make(input_name: str, output: str) -> int:
  """Write `output` from `input_name`; returns the number of tokens."""
  check(input_name, output)
  if input_name == PYTHON_DOCS:
    text = python_docs_text()
  else:
    try:
      with open(input_name, encoding="utf-8") as f:
        text = f.read()
    except UnicodeDecodeError as e:
      raise UserInputError(f"--input {input_name}: not UTF-8 text (byte {e.start:,})") from None
    except OSError as e:
      raise UserInputError(f"--input {input_name}: cannot be read ({e.strerror})") from None
  if not text:
    raise UserInputError(f"--input {input_name}: empty; there is nothing to train on")
  tokens = token_data.encode_bytes(text)
  try:
    token_data.write(output, tokens, token_data.BYTE_VOCAB_SIZE, "bytes (UTF-8)")
  except OSError as e:
    raise UserInputError(f"--output {output}: cannot be written ({e.strerror})") from None
  return len(tokens)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    platform_env.refuse(f"unexpected argument {argv[1]!r}; flags take the form --name=value")
  try:
    count = make(_INPUT.value, _OUTPUT.value)
  except UserInputError as e:
    platform_env.refuse(str(e))
  print(
    f"{count:,} tokens (byte-level, vocabulary {token_data.BYTE_VOCAB_SIZE}) -> {_OUTPUT.value}"
  )


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    platform_env.refuse(str(e))
    raise  # not reached: refuse exits


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
