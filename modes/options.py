"""A run's options (launch.py's flags, parsed) and what every mode derives from them: the
experiment with its overrides, the projection points, the measured point's options."""

import dataclasses

import experiments
import platform_env
from errors import UserInputError
from experiments import overrides
from hardware.catalog import Hardware
from measure import host_calibration
from measure.point import PointOptions
from parallelism.mesh import MeshLayout
from projection.plan import Target, plan
from report import points as printers
from report import results
from train import checkpoint as checkpoint_lib


@dataclasses.dataclass(frozen=True)
class Options:
  """launch.py's flags of the same names."""

  experiment: str = "tiny"
  mode: str = "train"
  steps: int | None = None
  devices: int | None = None
  output_dir: str = "runs"
  # Sweep mode: () unless given (the sweep's own points; launch.py).
  hardware: tuple[str, ...] = ("h100",)
  gpus: tuple[str, ...] = ("512",)  # as given: checked by projection_points
  top: int = 5
  search_budget: int = 0  # sweep mode: 0 unless given (each point as configured)
  full_compile: bool = False
  profile_steps: str | None = None
  checkpoint_dir: str | None = None
  checkpoint_every: int = 100
  keep_checkpoints: int = 3
  resume_from: int | None = None
  sets: tuple[str, ...] = ()  # --set KEY=VALUE, in order

  @property
  def how(self) -> str:
    """How a projected point's program is had (projection/project.py) in project and sweep
    mode, a best-configuration sweep's searches included: `auto`, `full` with
    --full_compile. Search mode compiles its candidates whole (modes/search.py)."""
    return "full" if self.full_compile else "auto"


def experiment(
  options: Options,
  mode: str,
  first: tuple[str, ...] = (),
  gpus: int | None = None,
  hardware: str | None = None,
) -> experiments.ExperimentConfig:
  """The experiment on `gpus` GPUs of `hardware` (what that target runs by default,
  experiments.at_target), then `first` and the user's --set overrides."""
  exp = experiments.load(options.experiment)
  if gpus is not None:
    exp = experiments.at_target(exp, gpus, hardware)
  exp = overrides.apply(exp, [*first, *options.sets])
  if options.steps:
    exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, steps=options.steps))
  if mode == "benchmark":
    exp = dataclasses.replace(exp, train=dataclasses.replace(exp.train, task="synthetic"))
  exp.model.validate()
  exp.train.validate()
  return exp


def announce(layout: MeshLayout, platform: str, pipeline_record: dict, trips: str) -> None:
  """A measured point's mesh and pipeline schedule, printed before it compiles."""
  print(printers.mesh_table(layout, platform))
  if pipeline_record:
    print(printers.pipeline_table(pipeline_record, layout.sizes["pipeline"], trips))


def point_options(options: Options) -> PointOptions:
  return PointOptions(
    announce=announce,
    output_dir=options.output_dir,
    profile_steps=options.profile_steps,
    checkpoint_dir=options.checkpoint_dir,
    checkpoint_every=options.checkpoint_every,
    keep_checkpoints=options.keep_checkpoints,
    resume_from=options.resume_from,
  )


def check_paths(options: Options) -> None:
  """Where results, TensorBoard scalars and checkpoints go must be usable before any
  compile: a run must not train to the end and then lose its record."""
  results.check_writable(options.output_dir)
  if options.checkpoint_dir is not None and options.mode in ("train", "benchmark"):
    checkpoint_lib.check_directory(options.checkpoint_dir)
  if options.checkpoint_every < 1:
    raise UserInputError(
      f"--checkpoint_every must be a positive integer, got {options.checkpoint_every}"
    )
  if options.keep_checkpoints < 1:
    raise UserInputError(
      f"--keep_checkpoints must be a positive integer, got {options.keep_checkpoints}"
    )
  if options.resume_from is not None:
    if options.checkpoint_dir is None or options.mode not in ("train", "benchmark"):
      raise UserInputError("--resume_from needs --checkpoint_dir, in the train or benchmark mode")
    if options.resume_from < 0:
      raise UserInputError(
        f"--resume_from must be a checkpoint's step (>= 0), got {options.resume_from}"
      )


def gpu_counts(options: Options) -> tuple[int, ...]:
  """--gpus as whole numbers."""
  counts = []
  for text in options.gpus:
    count = platform_env.whole_number(text.strip())
    if count is None or count < 1:
      raise UserInputError(f"--gpus takes positive whole numbers, got {text!r}")
    counts.append(count)
  return tuple(counts)


def hardware_names(options: Options) -> tuple[str, ...]:
  """--hardware as catalog names."""
  return tuple(name.strip().lower() for name in options.hardware)


def hardware_points(options: Options) -> list[tuple[Hardware, int]]:
  """Every (hardware, gpus) point of --hardware x --gpus, the names checked."""
  if not options.gpus or not options.hardware:
    raise UserInputError(
      f"--{'gpus' if not options.gpus else 'hardware'}: empty; give at least one, comma-separated"
    )
  counts = gpu_counts(options)
  names = hardware_names(options)
  return [(host_calibration.hardware(name, gpus), gpus) for name in names for gpus in counts]


def projection_points(options: Options) -> list[tuple[experiments.ExperimentConfig, Target]]:
  """Every point's experiment and its target, each planned once and all before the first
  compile."""
  points = []
  for hw, gpus in hardware_points(options):
    exp = experiment(options, "project", gpus=gpus, hardware=hw.name)
    points.append((exp, plan(exp, hw, gpus)))
  return points
