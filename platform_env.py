"""Choose JAX's platform before jax is imported, and keep a CPU-only start quiet.

Must run before the first `import jax`: XLA reads the host device count and
JAX_PLATFORMS once. On a machine without an NVIDIA GPU the CUDA plugin (installed for
deviceless GPU compiles) logs "Could not find cuda drivers" from C++ on every load;
those lines are swallowed unless the start fails, when they are replayed.
"""

import contextlib
import os
import sys
import tempfile

DEFAULT_HOST_DEVICES = 8


def has_nvidia_gpu() -> bool:
  return os.path.exists("/dev/nvidiactl")


@contextlib.contextmanager
def _captured_stderr():
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as sink:
    os.dup2(sink.fileno(), 2)
    try:
      yield
    except BaseException:
      os.dup2(saved, 2)
      sink.seek(0)
      sys.stderr.write(sink.read().decode(errors="replace"))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)


def launched_as_multiprocess() -> bool:
  """Started by srun or mpirun with more than one task: JAX's runtime must join them."""
  for variable in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if int(os.environ.get(variable, "1")) > 1:
      return True
  return False


def configure(host_devices: int = DEFAULT_HOST_DEVICES) -> None:
  """Use the CPU when there is no GPU, with `host_devices` emulated devices; join the
  other processes of a Slurm or Open MPI launch (before any backend starts)."""
  gpu = has_nvidia_gpu()
  if not gpu:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if os.environ.get("JAX_PLATFORMS") == "cpu":
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={host_devices}".strip()
  quiet = _captured_stderr() if not gpu else contextlib.nullcontext()
  with quiet:
    import jax  # pylint: disable=import-outside-toplevel
    if launched_as_multiprocess():
      # Coordinator, process count and id come from the Slurm / Open MPI environment.
      jax.distributed.initialize()
    jax.devices()
