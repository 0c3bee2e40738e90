"""Choose JAX's platform before jax is imported, and keep a CPU-only start quiet.

Must run before the first `import jax`: XLA reads the host device count and
JAX_PLATFORMS once. On a machine without an NVIDIA GPU the CUDA plugin (installed for
deviceless GPU compiles) logs "Could not find cuda drivers" from C++ on every load;
those lines are swallowed unless the start fails, when they are replayed.
"""

import contextlib
import ctypes
import dataclasses
import os
import re
import sys
import tempfile

DEFAULT_HOST_DEVICES = 8
# Emulated CPU devices cost memory and threads each; XLA starts 4,096 in about 3 s and
# 0.8 GB here, while hundreds of thousands never finish starting.
MAX_HOST_DEVICES = 4096
# JAX's default: a process that sends no heartbeat for this long is declared dead and
# every other process is terminated with an error naming it.
DEFAULT_HEARTBEAT_TIMEOUT_S = 100


@dataclasses.dataclass(frozen=True)
class Distributed:
  """How this process joins the others (flags; None: detected from Slurm / Open MPI)."""

  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S

  @property
  def from_flags(self) -> bool:
    return None not in (self.coordinator_address, self.num_processes, self.process_id)


def whole_number(text: str) -> int | None:
  """`text` as a non-negative whole number in ASCII digits, else None (str.isdigit alone
  accepts digits such as '²' that int() refuses)."""
  # Past 18 digits no count, port or id is meant (and int() refuses over 4,300 digits).
  if text.isascii() and text.isdigit() and len(text) <= 18:
    return int(text)
  return None


def refuse(message: str) -> None:
  """Bad input found before absl and launch.py's error handling exist: the same one line
  and exit code 2."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def distributed_from_argv(argv: list[str]) -> Distributed:
  """The distributed flags, read before absl parses them (jax must join before it starts).

  Malformed values are left for absl to reject; the flags must then come all together.
  """
  values = {}
  for arg in argv:
    name, _, value = arg.partition("=")
    name = name.lstrip("-")
    if name == "coordinator_address" and value:
      values[name] = value
    elif name in ("num_processes", "process_id", "heartbeat_timeout_s"):
      if whole_number(value) is not None:
        values[name] = whole_number(value)
  return Distributed(**values)


def check_distributed(distributed: Distributed) -> None:
  """Refuse values that would make jax.distributed.initialize hang or fail obscurely."""
  if distributed.heartbeat_timeout_s < 1:
    refuse(f"--heartbeat_timeout_s must be at least 1, got {distributed.heartbeat_timeout_s}")
  if not distributed.from_flags:
    return
  if distributed.num_processes < 1:
    refuse(f"--num_processes must be at least 1, got {distributed.num_processes}")
  if not 0 <= distributed.process_id < distributed.num_processes:
    refuse(
      f"--process_id must be in 0 .. --num_processes - 1 = "
      f"{distributed.num_processes - 1}, got {distributed.process_id}"
    )
  host, sep, port = distributed.coordinator_address.rpartition(":")
  number = whole_number(port)
  if not sep or not host or number is None or not 1 <= number <= 65535:
    refuse(
      f"--coordinator_address must be HOST:PORT with a port in 1 .. 65535, got "
      f"{distributed.coordinator_address!r}"
    )


def has_nvidia_gpu() -> bool:
  return os.path.exists("/dev/nvidiactl")


@contextlib.contextmanager
def captured_stderr():
  """Swallow what is written to file descriptor 2 (C++ logs included) unless the block
  raises, when it is replayed."""
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


def keep_freed_memory() -> None:
  """Make glibc's malloc keep freed memory for reuse instead of handing it back to the OS.

  XLA:CPU allocates a step's temporaries with malloc. By default blocks above the mmap
  threshold are mapped and unmapped on every step, so each step faults in fresh zeroed
  pages: about 430,000 page faults and 1.1 s of kernel time per cpu_gpt2_small step on
  this repo's 2-core host, 5% of its CPU time and up to 10% of its wall time. One arena,
  no mmap and no trimming serve them from the heap instead; the process keeps its peak
  memory, as GPU allocators do.
  """
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:
    return  # not glibc: nothing to tune
  m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8  # glibc's malloc.h
  for option, value in ((m_arena_max, 1), (m_mmap_max, 0), (m_trim_threshold, -1)):
    libc.mallopt(option, value)


def launched_as_multiprocess() -> bool:
  """Started by srun or mpirun with more than one task: JAX's runtime must join them."""
  for variable in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if int(os.environ.get(variable, "1")) > 1:
      return True
  return False


def _tasks_on_this_node() -> int | None:
  """Processes the launcher started on this node (None: not launched by Slurm / Open MPI)."""
  if "OMPI_COMM_WORLD_LOCAL_SIZE" in os.environ:
    return int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])
  if "SLURM_TASKS_PER_NODE" in os.environ and "SLURM_NODEID" in os.environ:
    # e.g. "4(x2),2": 4 tasks on each of the first two nodes, then 2.
    counts = []
    for part in os.environ["SLURM_TASKS_PER_NODE"].split(","):
      count, _, repeat = part.partition("(x")
      counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts[int(os.environ["SLURM_NODEID"])]
  return None


def _local_gpu_ids() -> list[int] | None:
  """All of this node's GPUs for a process that is alone on its node; else None.

  jax.distributed.initialize gives each Slurm / Open MPI process one GPU (its local
  rank) unless told otherwise; one process per node must be given all of them.
  """
  if _tasks_on_this_node() != 1 or not has_nvidia_gpu():
    return None
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible:
    return list(range(len(visible.split(","))))
  return list(range(len([d for d in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", d)])))


def configure(
  host_devices: int = DEFAULT_HOST_DEVICES, distributed: Distributed = Distributed()
) -> None:
  """Use the CPU when there is no GPU, with `host_devices` emulated devices; join the
  other processes of a Slurm or Open MPI launch, or those named by the distributed flags
  (before any backend starts)."""
  check_distributed(distributed)
  gpu = has_nvidia_gpu()
  if not gpu:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if os.environ.get("JAX_PLATFORMS") == "cpu":
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={host_devices}".strip()
      )
    keep_freed_memory()
  quiet = captured_stderr() if not gpu else contextlib.nullcontext()
  with quiet:
    import jax  # pylint: disable=import-outside-toplevel

    if distributed.from_flags or launched_as_multiprocess():
      if os.environ.get("JAX_PLATFORMS") == "cpu":
        # Cross-process collectives on CPU devices run over TCP with gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
      # Without the flags, the coordinator, process count and id come from the Slurm /
      # Open MPI environment. A dead process is noticed by the others through missing
      # heartbeats (or the coordinator's closed socket) and they abort with that error.
      jax.distributed.initialize(
        distributed.coordinator_address,
        distributed.num_processes,
        distributed.process_id,
        local_device_ids=None if distributed.from_flags else _local_gpu_ids(),
        heartbeat_timeout_seconds=distributed.heartbeat_timeout_s,
        shutdown_timeout_seconds=distributed.heartbeat_timeout_s,
      )
    jax.devices()
