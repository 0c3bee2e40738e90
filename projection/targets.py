"""Deviceless compilation for NVIDIA GPU targets.

XLA can compile a program for GPUs that are not present: jax-cuda12-plugin builds abstract
("compile-only") devices from a GpuTargetConfig textproto (hardware/targets/<name>.txtpb),
and `jax.jit(f, in_shardings=..., out_shardings=...).lower(*shape_dtype_structs).compile()`
on a mesh of those devices returns the real GPU program: async collectives, fusions, and
`memory_analysis()` (`cost_analysis()` is None there; use projection/hlo.py instead).

    devices = target_devices("h100", nodes=8, gpus_per_node=8)   # 64 abstract H100s
    mesh = jax.sharding.Mesh(np.array(devices).reshape(8, 8), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)

Set JAX_PLATFORMS=cpu before jax is imported. On a machine without a GPU the CUDA plugin
otherwise fails to initialize (it prints a CUDA-load traceback) and never registers its
topology factory, so no target can be built. With JAX_PLATFORMS=cpu it still registers the
factory, and jax computes on CPU. Even then, the plugin's stub logs "Could not find cuda
drivers" lines from C++ to stderr when jax is imported; platform_env.configure() swallows them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path

from hardware import catalog

TARGETS_DIR = Path(__file__).resolve().parent.parent / "hardware" / "targets"
HARDWARE = tuple(catalog.names())  # one target file each


def target_config(hardware: str) -> str:
  """The GpuTargetConfig textproto for a hardware name such as "h100"."""
  path = TARGETS_DIR / f"{hardware.lower()}.txtpb"
  if not path.is_file():
    raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(HARDWARE)}")
  return path.read_text()


@functools.lru_cache(maxsize=None)
def cuda_available() -> tuple[bool, str]:
  """(True, "") if deviceless CUDA compiles can be made here, else (False, one-line reason)."""
  try:
    plugin = importlib.util.find_spec("jax_plugins.xla_cuda12")
  except ModuleNotFoundError:  # no jax_plugins package: no CUDA plugin of any version
    plugin = None
  if plugin is None:
    return False, "jax-cuda12-plugin is not installed (pip install jax-cuda12-plugin)"
  try:
    target_devices("h100", 1, 1)
  except NotImplementedError:
    hint = (
      ""
      if os.environ.get("JAX_PLATFORMS") == "cpu"
      else "; on a machine without a GPU set JAX_PLATFORMS=cpu before importing jax"
    )
    return False, f"the CUDA plugin registered no GPU topology (plugin failed to initialize{hint})"
  except Exception as e:  # any other failure: report its first line
    return False, f"deviceless CUDA topology failed: {str(e).strip().splitlines()[0]}"
  return True, ""


def target_devices(hardware: str, nodes: int, gpus_per_node: int) -> list:
  """Abstract devices of `nodes` x `gpus_per_node` GPUs; device.process_index is the node.
  Ids run node-major (node n holds ids n*gpus_per_node ...)."""
  from jax.experimental import topologies  # deferred: JAX_PLATFORMS must be set first

  # Topology "<slices>x<hosts per slice>x<devices per host>"; one slice of `nodes` hosts.
  topo = topologies.get_topology_desc(
    platform="cuda", topology=f"1x{nodes}x{gpus_per_node}", target_config=target_config(hardware)
  )
  return list(topo.devices)


@contextlib.contextmanager
def cudnn_version_of(hardware: str) -> Iterator[None]:
  """While active, tracing cuDNN attention (jax.nn.dot_product_attention(implementation=
  "cudnn"), and latent attention's narrower values through the same kernel, model/attention.py)
  sees the target config's cuDNN version and compute capability instead of asking the cuDNN
  library and the backend's GPUs, which a deviceless compile does not have; XLA then
  compiles the fused attention for the target (checked: H100, forward and backward
  custom-calls; GB200 with 192-dim keys and 128-dim values). JAX offers no public hook, so
  this swaps its private checks and puts them back."""
  from jax._src.cudnn import fused_attention_stablehlo as fused  # deferred, as above

  config = target_config(hardware)
  m = re.search(r"dnn_version_info\s*{\s*major:\s*(\d+)\s*minor:\s*(\d+)", config)
  if m is None:
    raise ValueError(f"{hardware}: the target config has no dnn_version_info")
  version = int(m.group(1)) * 10000 + int(m.group(2)) * 100  # cuDNN 9's encoding
  # A text proto leaves out a zero field: H100's is "major: 9" alone.
  c = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)(?:\s*minor:\s*(\d+))?", config)
  if c is None:
    raise ValueError(f"{hardware}: the target config has no cuda_compute_capability")
  capability = (int(c.group(1)), int(c.group(2) or 0))
  saved = fused.check_cudnn_version, fused.check_compute_capability
  fused.check_cudnn_version = lambda: version
  # "at least": head dims over 128 and latent attention need Hopper or later.
  fused.check_compute_capability = lambda at: capability >= tuple(map(int, at.split(".")))
  try:
    yield
  finally:
    fused.check_cudnn_version, fused.check_compute_capability = saved
