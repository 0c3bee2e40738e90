"""Analyses of deviceless compiles kept on disk between runs, keyed by what they depend on.

A compile for a large target takes minutes on 2 cores (DeepSeek-V3 671B: two of
120-146 s each), and projecting the same point again (a docs table regenerated, a sweep
resumed, another hardware figure tried on the same program) would repeat it. What is
kept is the compile's analysis (projection/hlo.py's Program, memory per device), under a
key made of the caller's inputs, the jax and CUDA plugin versions, XLA_FLAGS and a digest
of the code that builds, compiles and reads the program: an edit of that code, a new
jax or other flags make new keys, so an analysis made by other code is never read back.

Two callers: projection/compose.py's pieces and projection/aot_compile.py's whole step.
Each keeps its entries in a folder of its own beside XLA's kernel cache
(projection/kernel_cache.py), which an environment variable moves (or turns off: "off").
"""

import contextlib
import functools
import glob
import hashlib
import importlib.metadata
import os
import pickle
from collections.abc import Callable

import jax

from projection import kernel_cache

# The packages whose code shapes a compiled program and its analysis.
_CODE_PACKAGES = ("model", "parallelism", "train", "projection", "hardware")
OFF = "off"
# A folder's entries beyond this many bytes are removed, least recently used first (an
# analysis is 0.1 to 3 MB: GPT-3 175B's 0.6, DeepSeek-V3 671B's 2.6).
MAX_FOLDER_BYTES = 2 * 1024**3


def folder(env: str, name: str) -> str | None:
  """The folder of one cache: $env, else `name` beside the kernel cache; None when $env
  is "off"."""
  chosen = os.environ.get(env)
  if chosen == OFF:
    return None
  return chosen or os.path.join(os.path.dirname(kernel_cache.DEFAULT_KERNEL_CACHE), name)


@functools.cache
def code_digest() -> str:
  """A digest of the Python sources in _CODE_PACKAGES (read once a process)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  digest = hashlib.sha256()
  for package in _CODE_PACKAGES:
    for path in sorted(glob.glob(os.path.join(root, package, "**", "*.py"), recursive=True)):
      digest.update(os.path.relpath(path, root).encode())
      with open(path, "rb") as f:
        digest.update(f.read())
  return digest.hexdigest()


def _plugin_version() -> str:
  try:
    return importlib.metadata.version("jax-cuda12-plugin")
  except importlib.metadata.PackageNotFoundError:
    return "none"


def key(*parts) -> str:
  """A file name for `parts` (reprs of frozen dataclasses and plain values) compiled by
  this jax, plugin, XLA_FLAGS and code."""
  everything = (
    parts,
    jax.__version__,
    _plugin_version(),
    os.environ.get("XLA_FLAGS", ""),
    code_digest(),
  )
  return hashlib.sha256(repr(everything).encode()).hexdigest()[:24] + ".pkl"


def read(path: str, valid: Callable[[object], bool]) -> object | None:
  """What is cached at `path` if `valid` says it is whole, else None: a missing, truncated,
  corrupt or foreign file is compiled anew (and replaced), never an error."""
  try:
    with open(path, "rb") as f:
      cached = pickle.load(f)
  except Exception:  # pylint: disable=broad-except (unpickling garbage raises anything)
    return None
  if not valid(cached):
    return None
  with contextlib.suppress(OSError):
    os.utime(path)  # used now: the last to be removed (`_trim`)
  return cached


def write(path: str, value: object) -> None:
  """`value` at `path`, atomically: a reader sees no file or the whole one."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}"
    with open(partial, "wb") as f:
      pickle.dump(value, f)
    os.replace(partial, path)
    _trim(os.path.dirname(path), MAX_FOLDER_BYTES)
  except OSError:
    pass  # a cache that cannot be written costs time, not correctness


def _trim(folder: str, max_bytes: int) -> None:
  """Remove `folder`'s least recently used entries until it holds at most `max_bytes`."""
  entries = []
  for entry in os.scandir(folder):
    with contextlib.suppress(OSError):  # another process may remove it meanwhile
      stat = entry.stat()
      entries.append((stat.st_mtime, stat.st_size, entry.path))
  total = sum(size for _, size, _ in entries)
  for _, size, path in sorted(entries):
    if total <= max_bytes:
      break
    with contextlib.suppress(OSError):
      os.remove(path)
    total -= size
