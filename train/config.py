"""Training configuration: batch, schedule and optimizer settings."""

import dataclasses
import math

from errors import UserInputError

TASKS = ("synthetic", "learnable", "tokens")
PIPELINE_SCHEDULES = ("gpipe", "interleaved", "1f1b")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  global_batch: int = 16  # sequences per step, over all devices
  # Sequences per data-parallel replica in one micro-batch; the replica's share of the
  # global batch runs as micro-batches in sequence, gradients summed (activation memory
  # of one micro-batch at the cost of a loop). 0: the whole share at once.
  micro_batch: int = 0
  # With mesh.pipeline > 1 the micro-batches flow through the pipeline stages instead
  # (parallelism/pipeline.py). gpipe: each stage's layers in one piece; interleaved: in
  # `virtual_stages` chunks, a micro-batch circling the stages that many times; 1f1b:
  # either (by virtual_stages), each micro-batch's backward run as soon as its forward
  # is through, so only the micro-batches in flight keep activations
  # (parallelism/one_f_one_b.py).
  pipeline_schedule: str = "gpipe"
  virtual_stages: int = 1
  # The micro-batches go through the pipeline in this many passes (a forward and a
  # backward loop each), gradients summed: the schedule runs every forward trip of a
  # pass before its backward ones, so a pass keeps the activations of all its
  # micro-batches; passes of P micro-batches keep as many as 1F1B keeps in flight, at
  # the price of each pass's P - 1 fill and drain trips (and, with FP8, one weight cast
  # per pass). 0: the most passes of at least P micro-batches each
  # (parallelism/pipeline.py `passes`).
  pipeline_passes: int = 1
  # Adam's moments split over `data` (Megatron's distributed optimizer, ZeRO stage 1):
  # 1 / data of their memory, the same bytes moved (gradients reduce-scattered, updated
  # parameters all-gathered, instead of all-reduced gradients). With model.fp8 or
  # block scaling the matmul kernels are split too: each step gathers the FP8 casts, or
  # the kernels to quantize (train/step.py).
  shard_optimizer: bool = False
  # With shard_optimizer and the 1f1b schedule at virtual_stages >= 2: the layer weights'
  # gradients reduce-scattered over `data` while the drain's last trips still compute
  # (Megatron's --overlap-grad-reduce; parallelism/one_f_one_b.py), not after the step.
  overlap_grad_reduce: bool = True
  # With shard_optimizer, block scaling and the 1f1b schedule at virtual_stages >= 2: each
  # chunk's kernels gathered over `data` and quantized in the fill loop, an iteration ahead
  # of the chunk's first trip (Megatron's --overlap-param-gather;
  # parallelism/one_f_one_b.py), not all before the first trip. Off by default: it cuts the
  # whole bf16 copies' memory (Llama 3.1 405B, 512 GB300: 255 -> 227 GB a GPU), but XLA's
  # GPU scheduler runs each gather between the trips' tensor-parallel collectives, not
  # beside them, and the step is no faster (13.61 -> 13.66 s; docs/pipelines.md).
  overlap_param_gather: bool = False
  steps: int = 10  # timed / trained steps
  warmup_steps: int = 2  # excluded from timing (compilation caches, allocators)
  learning_rate: float = 3e-4
  lr_warmup_steps: int = 2
  lr_decay_steps: int = 0  # 0: decay over `steps`
  min_lr_ratio: float = 0.1  # GPT-3 decays to 10% of the peak rate
  weight_decay: float = 0.1
  beta1: float = 0.9
  beta2: float = 0.95
  eps: float = 1e-8
  grad_clip: float = 1.0
  seed: int = 0
  # A step whose loss exceeds this many times the previous step's stops the run like a
  # non-finite loss, and the checkpoint it ran from is not counted good (train/checkpoint.py
  # keeps the newest good one out of rotation); 0: only non-finite losses stop a run.
  loss_jump_factor: float = 0.0
  # synthetic: uniform random tokens; learnable: see train/data.py; tokens: a token file
  task: str = "synthetic"
  data_path: str = ""  # tokens: a flat binary of uint16 ids (train/token_data.py)

  def validate(self) -> None:
    for field in ("global_batch", "steps"):
      if getattr(self, field) < 1:
        raise UserInputError(
          f"train.{field} must be a positive integer, got {getattr(self, field)}"
        )
    for field in ("micro_batch", "warmup_steps", "lr_warmup_steps", "lr_decay_steps"):
      if getattr(self, field) < 0:
        raise UserInputError(f"train.{field} must be >= 0, got {getattr(self, field)}")
    if self.pipeline_schedule not in PIPELINE_SCHEDULES:
      raise UserInputError(
        f"train.pipeline_schedule must be one of "
        f"{', '.join(PIPELINE_SCHEDULES)}, got {self.pipeline_schedule!r}"
      )
    if self.pipeline_passes < 0:
      raise UserInputError(
        f"train.pipeline_passes must be >= 0 (0: as 1F1B keeps in flight), "
        f"got {self.pipeline_passes}"
      )
    if self.virtual_stages < 1:
      raise UserInputError(
        f"train.virtual_stages must be a positive integer, got {self.virtual_stages}"
      )
    if self.pipeline_schedule == "gpipe" and self.virtual_stages != 1:
      raise UserInputError(
        f"train.virtual_stages must be 1 with the gpipe schedule, got "
        f"{self.virtual_stages} (interleaved takes more)"
      )
    if self.pipeline_schedule == "interleaved" and self.virtual_stages < 2:
      raise UserInputError(
        f"train.virtual_stages must be at least 2 with the interleaved "
        f"schedule, got {self.virtual_stages} (1 is gpipe)"
      )
    if self.pipeline_schedule == "1f1b" and self.pipeline_passes > 1:
      raise UserInputError(
        f"train.pipeline_passes must be 0 or 1 with the 1f1b schedule, got "
        f"{self.pipeline_passes} (it keeps only what is in flight anyway)"
      )
    if self.task not in TASKS:
      raise UserInputError(f"train.task must be one of {', '.join(TASKS)}, got {self.task!r}")
    if self.task == "tokens" and not self.data_path:
      raise UserInputError("train.data_path must name a token file when train.task=tokens")
    self._validate_optimizer()
    if not (
      math.isfinite(self.loss_jump_factor)
      and (self.loss_jump_factor == 0 or self.loss_jump_factor > 1)
    ):
      raise UserInputError(
        f"train.loss_jump_factor must be 0 (off) or a finite number above 1, "
        f"got {self.loss_jump_factor}"
      )
    if not 0 <= self.seed < 2**32:
      raise UserInputError(f"train.seed must be in 0 .. 2**32 - 1, got {self.seed}")

  def _validate_optimizer(self) -> None:
    """Values that parse but cannot train: each would give NaNs or no update at all."""
    # (field, lowest, lowest allowed itself, highest, highest allowed itself)
    ranges = (
      ("learning_rate", 0, False, math.inf, False),
      ("beta1", 0, True, 1, False),
      ("beta2", 0, True, 1, False),
      ("eps", 0, False, math.inf, False),
      ("weight_decay", 0, True, math.inf, False),
      ("grad_clip", 0, False, math.inf, False),
      ("min_lr_ratio", 0, True, 1, True),
    )
    for field, low, low_ok, high, high_ok in ranges:
      value = getattr(self, field)
      above = value >= low if low_ok else value > low
      below = value <= high if high_ok else value < high
      if not (math.isfinite(value) and above and below):
        left, right = "[" if low_ok else "(", "]" if high_ok else ")"
        high_text = "inf" if high == math.inf else high
        raise UserInputError(
          f"train.{field} must be a finite number in {left}{low}, {high_text}{right}, got {value}"
        )
