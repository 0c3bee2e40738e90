"""Run the compiled train step and time it.

Lowering and compilation are timed apart from running; the first `warmup_steps`
executions are run but not timed; every timed step ends in `block_until_ready`, and
its batch is generated and placed on the devices before the clock starts.

With checkpoints the run resumes from the newest one, saves after every step the
interval names and after the last, and on SIGTERM / SIGINT saves and stops (without
checkpoints it just stops after the step). A signal before the first step (restoring,
compiling) ends the process at once with one line: nothing is being written then. A
non-finite loss stops the run before that step's state can be saved, and so does a
non-finite parameter or optimizer moment at a save.
"""

import dataclasses
import math
import time
from collections.abc import Sequence

import jax

from errors import RunStopped
from model.config import ModelConfig
from train import input_pipeline, preemption
from train.checkpoint import Checkpoints, NonFiniteState
from train.config import TrainConfig
from train.hooks import StepHook
from train.step import TrainProgram


@dataclasses.dataclass(frozen=True)
class RunResult:
  lower_s: float
  compile_s: float
  step_times_s: list[float]  # timed steps only
  losses: list[float]  # every step this process ran, warm-up included
  final_state: object
  first_step: int = 0  # > 0: resumed from the checkpoint of this step


def run(
  program: TrainProgram,
  model_cfg: ModelConfig,
  train_cfg: TrainConfig,
  checkpoints: Checkpoints | None = None,
  hooks: Sequence[StepHook] = (),
) -> RunResult:
  B, T = train_cfg.global_batch, model_cfg.seq_len
  # Hooks and checkpoints close on every exit (a run stopped by a signal or a bad loss
  # keeps its scalars; orbax's threads end before the interpreter does).
  try:
    # A checkpoint that cannot be restored is reported before the compile.
    with preemption.ExitOnSignal("before the first step; nothing was being written"):
      batches = input_pipeline.BatchSource(train_cfg, model_cfg, program.batch_sharding)
      state = checkpoints.restore_latest(program.abstract_state, batches) if checkpoints else None
      t0 = time.perf_counter()
      lowered = program.lower(B, T)
      t1 = time.perf_counter()
      compiled = lowered.compile()
      t2 = time.perf_counter()
      first_step = 0 if state is None else int(state.step)
      state = program.init() if state is None else state
    total = train_cfg.warmup_steps + train_cfg.steps
    step_times, losses = [], []
    with preemption.StopRequest(jax.process_count()) as stop:
      for step in range(first_step, total):
        batch = jax.block_until_ready(batches.batch(step))
        for hook in hooks:
          hook.before_step(step)
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        elapsed = time.perf_counter() - start
        if step >= train_cfg.warmup_steps:
          step_times.append(elapsed)
        loss = float(metrics["loss"])
        problem = _loss_problem(loss, losses[-1] if losses else None, train_cfg.loss_jump_factor)
        if checkpoints:
          checkpoints.record_loss(step, loss, good=not problem)
        if problem:
          raise RunStopped(
            _stopped(f"{problem} at step {step}", checkpoints, "the bad step was not saved"), 1
          )
        losses.append(loss)
        for hook in hooks:
          hook.after_step(step, metrics, elapsed)
        signum = stop.signal_number()
        if checkpoints:
          try:
            checkpoints.save(step + 1, state, batches, force=bool(signum) or step + 1 == total)
          except NonFiniteState as e:
            raise RunStopped(
              _stopped(f"{e}", checkpoints, "the bad state was not saved"), 1
            ) from None
        if signum:
          raise RunStopped(
            _stopped(
              f"signal {signum} after step {step}", checkpoints, "rerun the same command to resume"
            ),
            preemption.EXIT_CODE_BASE + signum,
          )
      if checkpoints:
        checkpoints.close()  # inside: a signal while the last save finishes is ignored
  finally:
    for hook in hooks:
      hook.close()
    if checkpoints:
      checkpoints.close()
  return RunResult(t1 - t0, t2 - t1, step_times, losses, state, first_step)


def _loss_problem(loss: float, previous: float | None, jump_factor: float) -> str:
  """Why `loss` stops the run ("" if it does not): not finite, or a jump beyond the factor."""
  if not math.isfinite(loss):
    return f"loss is {loss}"
  if jump_factor and previous is not None and loss > jump_factor * previous:
    return (
      f"loss jumped from {previous:.4g} to {loss:.4g}, more than train.loss_jump_factor "
      f"= {jump_factor:g} times"
    )
  return ""


def _stopped(reason: str, checkpoints: Checkpoints | None, note: str) -> str:
  """Finish the saves in flight; say which checkpoint is the newest, and the newest good."""
  if not checkpoints:
    return f"{reason}; stopped (no --checkpoint_dir: nothing saved)"
  checkpoints.close()
  latest, good = checkpoints.latest_step(), checkpoints.newest_good_step()
  where = f"the newest checkpoint is step {latest}" if latest is not None else "none saved yet"
  if good is not None and good != latest:
    where += f", the newest known good step {good} (a rerun resumes from it)"
  return f"{reason}; stopped: {where} in {checkpoints.directory} ({note})"
