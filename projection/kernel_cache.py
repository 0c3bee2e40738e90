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
import tempfile

import jax

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
    shutil.copyfile(shared, private)
  atexit.register(_save_kernel_cache, private, shared)
  return private


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
