"""XLA's kernel cache for deviceless compiles, kept between runs.

Compiles of one model on other meshes or GPU generations share most kernels, and a
compile whose kernels are cached takes ~5-10 s instead of 15-30 s. It holds only machine
code, which the projection never runs, so a reused kernel cannot change a projection
(checked: identical HLO with and without it, even across generations).
"""

import atexit
import functools
import os
import shutil
import sys
import tempfile

import jax
from google.protobuf import empty_pb2, message

KERNEL_CACHE_ENV = "JAX_SCALING_KERNEL_CACHE"  # overrides the file's path
DEFAULT_KERNEL_CACHE = os.path.join(
  os.path.expanduser("~"), ".cache", "jax-scaling", f"xla-kernels-jax-{jax.__version__}.bin"
)


@functools.cache
def path() -> str:
  """The file of this process's copy of the kernel cache: XLA appends to the file it is given, so
  concurrent runs each work on a copy and replace the shared file whole at exit."""
  shared = os.environ.get(KERNEL_CACHE_ENV) or DEFAULT_KERNEL_CACHE
  directory = tempfile.mkdtemp(prefix="projection-kernels-")
  private = os.path.join(directory, "kernels.bin")
  if os.path.isfile(shared):
    if _readable(shared):
      shutil.copyfile(shared, private)
    else:
      print(
        f"note: the kernel cache {shared} is not a kernel cache XLA can read (corrupt or "
        f"truncated); compiling without it, and replacing it at exit",
        file=sys.stderr,
      )
  atexit.register(_save_kernel_cache, private, shared)
  return private


def _readable(cache: str) -> bool:
  """Whether `cache` is well-formed protocol-buffer wire format, as XLA's kernel cache is: XLA
  fails the whole compile on one it cannot parse. Parsed as an empty message, every field is
  skipped, so this checks the encoding without knowing XLA's message."""
  try:
    with open(cache, "rb") as f:
      empty_pb2.Empty().ParseFromString(f.read())
  except (OSError, message.DecodeError):
    return False
  return True


def _save_kernel_cache(private: str, shared: str) -> None:
  try:
    if os.path.isfile(private):
      os.makedirs(os.path.dirname(shared), exist_ok=True)
      partial = f"{shared}.{os.getpid()}"
      shutil.copyfile(private, partial)
      os.replace(partial, shared)  # atomic: readers see the old file or the new one
  except OSError:
    pass  # a cache that cannot be written costs time, not correctness
  finally:
    shutil.rmtree(os.path.dirname(private), ignore_errors=True)
