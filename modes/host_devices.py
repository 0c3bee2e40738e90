"""How many host CPU devices a run needs, read from argv before jax starts (XLA sizes
the host platform once, at start-up). Imports nothing that imports jax."""

import platform_env

# Projection compiles a reduced mesh (model-parallel axes at full size) on host CPU
# devices when it cannot compile for the GPU itself; this many cover GPT-3 175B's.
PROJECTION_HOST_DEVICES = 512


def _projects(argv: list[str]) -> bool:
  """Whether the run projects: --mode=project or search, or a sweep whose definition projects."""
  if "--mode=project" in argv or "--mode=search" in argv:
    return "--hardware=host" not in argv
  if "--mode=sweep" in argv:
    # The experiments package and its sweep modules import no jax (experiments/__init__.py).
    import experiments  # pylint: disable=import-outside-toplevel

    names = [a.split("=", 1)[1] for a in argv if a.startswith("--experiment=")]
    name = names[-1] if names else ""
    return name in experiments.sweep_names() and experiments.sweep(name).mode == "project"
  return False


def from_argv(argv: list[str]) -> int:
  """--devices when it asks for more than the default, else what the mode needs (a
  malformed --devices is left for absl to reject)."""
  for arg in argv:
    if arg.startswith("--devices="):
      value = platform_env.whole_number(arg.split("=", 1)[1])
      too_many = value is not None and value > platform_env.MAX_HOST_DEVICES
      if too_many and not platform_env.has_nvidia_gpu():
        platform_env.refuse(
          f"--devices: at most {platform_env.MAX_HOST_DEVICES:,} emulated "
          f"CPU devices, got {value:,}"
        )
      if value is not None and value > platform_env.DEFAULT_HOST_DEVICES:
        return value
  if _projects(argv):
    return PROJECTION_HOST_DEVICES
  return platform_env.DEFAULT_HOST_DEVICES
