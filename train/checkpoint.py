"""Orbax checkpoints of the train state and the data iterator's position.

Saves are asynchronous: `save` returns once the arrays are copied off the devices and
tensorstore writes them in the background while training goes on. Orbax writes each
step into a temporary directory and renames it when every process has finished, so a
crash during a save leaves the earlier checkpoints as they were, and a restart resumes
from the newest finished one.

Orbax does not notice a data file that was altered after the save, so once a save has
finished process 0 writes a manifest of every file's size and SHA-256 into the step's
directory; a restore checks it first (each process a share of the files) and refuses a
checkpoint that differs, naming the file. A finished step whose manifest was not yet
written (the process died in between) is restored unchecked, with a note.

A kill can leave a step's temporary directory (or a half-written manifest) behind.
Orbax's own clean-up of temporary directories runs in the background, racing the first
save of the resumed run, which may write the same step's temporary directory; so they
are removed here, before the manager starts, and a manifest is written only for a step
whose directory has its final name. A state with a non-finite parameter or optimizer
moment is never saved (`NonFiniteState`), and a restored state is checked the same way.

A state can be finite and still ruined (a learning rate of 1e30): only the loss of the
step run from it tells. So the loss of the step that ran from each checkpoint is kept in
`step_losses.json` beside them, with whether it was good (finite, and no jump beyond
train.loss_jump_factor). Rotation keeps the newest `keep` checkpoints and, out of
rotation, the newest good one, so a diverging run cannot rotate out the last state known
to train. A resume starts from the newest checkpoint not known bad, or the one
--resume_from names; the checkpoints after it are moved into `set_aside/` (never
deleted), so the resumed run can save its own steps under those numbers.
"""

import hashlib
import json
import os
import pathlib
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from errors import UserInputError
from train.input_pipeline import BatchSource
from train.step import TrainState

# {step: {"loss": the loss of the step run from that checkpoint, "good": bool}}
STEP_LOSSES = "step_losses.json"
SET_ASIDE = "set_aside"  # checkpoints after the one resumed from
MANIFEST = "manifest.sha256.json"
PARTIAL_MANIFEST = f"{MANIFEST}.partial"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's atomicity_types.TMP_DIR_SUFFIX


class NonFiniteState(Exception):
  """The state to be saved holds a NaN or an infinity: it was not saved."""

  def __init__(self, step: int):
    super().__init__(
      f"the state after step {step - 1} has a non-finite parameter or optimizer moment"
    )
    self.step = step


@jax.jit
def _all_finite(tree) -> jax.Array:
  checks = [
    jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


def is_finite(state) -> bool:
  """Whether every floating-point leaf of `state` is finite (the same on every process)."""
  return bool(_all_finite(state))


def _digest(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _files(step_dir: pathlib.Path) -> list[str]:
  return sorted(
    str(p.relative_to(step_dir))
    for p in step_dir.rglob("*")
    if p.is_file() and p.name not in (MANIFEST, PARTIAL_MANIFEST)
  )


def remove_leftovers(directory: pathlib.Path) -> list[str]:
  """Delete what a killed save leaves: step directories still under their temporary name
  and half-written manifests. Returns what was removed (names under `directory`)."""
  removed = []
  if not directory.is_dir():
    return removed
  for entry in sorted(directory.iterdir()):
    if TMP_SUFFIX in entry.name:
      if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
      else:
        entry.unlink()
      removed.append(entry.name)
    elif entry.is_dir() and (entry / PARTIAL_MANIFEST).exists():
      (entry / PARTIAL_MANIFEST).unlink()
      removed.append(f"{entry.name}/{PARTIAL_MANIFEST}")
  return removed


def _can_create_in(directory: pathlib.Path) -> bool:
  """Tried with an empty directory, removed at once (permission bits alone miss
  read-only file systems, and root passes them all)."""
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=directory))
  except OSError:
    return False
  return True


def check_directory(directory: str) -> None:
  """Refuse a checkpoint directory that cannot be used, before anything is compiled."""
  if not directory.strip():
    raise UserInputError("--checkpoint_dir: empty; name a directory (or leave the flag out)")
  path = pathlib.Path(os.path.abspath(directory))
  if path.exists() and not path.is_dir():
    raise UserInputError(f"--checkpoint_dir {path} is a file, not a directory")
  existing = path
  while not existing.exists():
    existing = existing.parent
  if not existing.is_dir():
    raise UserInputError(f"--checkpoint_dir {path}: {existing} is a file, not a directory")
  if not _can_create_in(existing):
    raise UserInputError(f"--checkpoint_dir {path}: nothing can be created in {existing}")


def finished_steps(directory: pathlib.Path) -> list[int]:
  """Steps whose directory has its final name (orbax renames it when the save is done)."""
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def read_step_losses(directory: pathlib.Path) -> dict[int, dict]:
  """The recorded loss of the step run from each checkpoint ({} when none or unreadable:
  every checkpoint is then of unknown health, and the newest is resumed as before)."""
  try:
    return {int(k): v for k, v in json.loads((directory / STEP_LOSSES).read_text()).items()}
  except (OSError, ValueError, AttributeError):
    return {}


def choose_resume_step(
  steps: list[int], losses: dict[int, dict], resume_from: int | None
) -> tuple[int | None, str]:
  """The checkpoint to resume from and a note for the user ("" when it is simply the newest).

  Without --resume_from: the newest checkpoint not known bad. A known-bad one is a step
  whose loss, run from it, was not finite or jumped.
  """
  listed = ", ".join(str(s) for s in steps) or "none"
  if resume_from is not None:
    if resume_from not in steps:
      raise UserInputError(
        f"--resume_from: no checkpoint of step {resume_from} in the checkpoint directory; "
        f"it has: {listed}"
      )
    health = losses.get(resume_from)
    said = "" if health is None else f" (the step run from it had loss {health['loss']})"
    return resume_from, f"resuming from checkpoint {resume_from}, as --resume_from asks{said}"
  if not steps:
    return None, ""
  good = [s for s in steps if losses.get(s, {}).get("good", True)]
  if not good:
    raise UserInputError(
      f"--checkpoint_dir: every checkpoint ({listed}) was followed by a non-finite or "
      f"jumping loss; choose one with --resume_from=STEP, or move them away to start anew"
    )
  if good[-1] == steps[-1]:
    return steps[-1], ""
  bad = [s for s in steps if s > good[-1]]
  losses_text = ", ".join(f"step {s}: {losses[s]['loss']}" for s in bad)
  return good[-1], (
    f"resuming from checkpoint {good[-1]}, the newest whose loss was good; the steps run "
    f"from the newer ones diverged ({losses_text})"
  )


class Checkpoints:
  """Save every `every_steps` steps, keep the newest `keep` and the newest known good one,
  resume from the newest not known bad (or `resume_from`)."""

  def __init__(self, directory: str, every_steps: int, keep: int, resume_from: int | None = None):
    if every_steps < 1:
      raise UserInputError(f"--checkpoint_every must be a positive integer, got {every_steps}")
    if keep < 1:
      raise UserInputError(f"--keep_checkpoints must be a positive integer, got {keep}")
    self.directory = pathlib.Path(os.path.abspath(directory))
    self._keep = keep
    # Checked here: orbax would fail on it in a background thread, with a traceback.
    check_directory(directory)
    if jax.process_index() == 0:
      remove_leftovers(self.directory)
    if jax.process_count() > 1:  # no process may list the directory before it is clean
      multihost_utils.sync_global_devices("checkpoint leftovers removed")
    self._losses = read_step_losses(self.directory)
    steps = finished_steps(self.directory)
    self.resume_step, note = choose_resume_step(steps, self._losses, resume_from)
    later = [s for s in steps if self.resume_step is not None and s > self.resume_step]
    if jax.process_count() > 1:  # every process has decided before any directory moves
      multihost_utils.sync_global_devices("checkpoint to resume from chosen")
    for step in later:  # the resumed run saves these steps anew
      self._losses.pop(step, None)
    if later and jax.process_index() == 0:
      where = self._set_aside(later)
      self._write_losses()
      note += f"; the later checkpoints ({', '.join(map(str, later))}) moved to {where}"
    if note and jax.process_index() == 0:
      print(f"note: {note}", flush=True)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("later checkpoints set aside")
    self._closed = False
    # Orbax reports every stage of every save at INFO; warnings and errors still show.
    logging.set_verbosity(logging.WARNING)
    try:
      self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
          save_interval_steps=every_steps,
          # Rotation is `_rotate`'s: orbax's would not keep the newest good checkpoint.
          max_to_keep=None,
          enable_async_checkpointing=True,
          # Done above, synchronously (orbax's runs in the background).
          cleanup_tmp_directories=False,
          create=True,
        ),
      )
    except Exception as e:  # pylint: disable=broad-except
      raise UserInputError(
        f"--checkpoint_dir {self.directory} cannot be used: {type(e).__name__}: {_first_line(e)}"
      ) from e

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def newest_good_step(self) -> int | None:
    """The newest checkpoint whose following step's loss was good (kept out of rotation)."""
    good = [s for s in self._manager.all_steps() if self._losses.get(s, {}).get("good")]
    return max(good) if good else None

  def record_loss(self, step: int, loss: float, good: bool) -> None:
    """The loss of `step`, run from the checkpoint of step `step` if there is one."""
    if step not in self._manager.all_steps():
      return
    self._losses[step] = {"loss": loss, "good": good}
    if jax.process_index() == 0:
      self._write_losses()

  def _write_losses(self) -> None:
    partial = self.directory / f"{STEP_LOSSES}.partial"
    partial.write_text(json.dumps({str(k): v for k, v in sorted(self._losses.items())}))
    partial.rename(self.directory / STEP_LOSSES)  # atomic: whole or the previous one

  def _set_aside(self, steps: list[int]) -> pathlib.Path:
    """Move the checkpoints of `steps` into set_aside/ (a numbered folder per resume)."""
    root = self.directory / SET_ASIDE
    root.mkdir(exist_ok=True)
    n = 1
    while (root / str(n)).exists():
      n += 1
    (root / str(n)).mkdir()
    for step in steps:
      (self.directory / str(step)).rename(root / str(n) / str(step))
    return root / str(n)

  def _rotate(self) -> None:
    """Delete the finished checkpoints beyond the newest `keep`, except the newest good one."""
    steps = sorted(self._manager.all_steps())
    kept = set(steps[-self._keep :]) | {self.newest_good_step()}
    removed = [step for step in steps if step not in kept]
    for step in removed:
      self._manager.delete(step)
      self._losses.pop(step, None)
    if removed and jax.process_index() == 0:
      self._write_losses()

  def restore_latest(self, abstract_state: TrainState, batches: BatchSource) -> TrainState | None:
    """The newest checkpoint onto `abstract_state`'s shardings (any mesh), the data
    iterator moved to its position; None when there is none."""
    step = self._manager.latest_step()
    if step is None:
      return None
    step_dir = self.directory / str(step)
    self._verify(step, step_dir)
    self._check_compatible(step_dir, abstract_state)
    args = {"state": ocp.args.StandardRestore(abstract_state)}
    if batches.iterator is not None:
      import grain  # pylint: disable=import-outside-toplevel (token files only; optional)

      args["data"] = grain.checkpoint.CheckpointRestore(batches.iterator)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**args))
    except Exception as e:  # pylint: disable=broad-except
      raise UserInputError(
        f"--checkpoint_dir: checkpoint {step_dir} cannot be restored "
        f"({type(e).__name__}: {_first_line(e)}); it was left as it is: "
        f"move it away to resume from an earlier one"
      ) from e
    if not is_finite(restored["state"]):
      raise UserInputError(
        f"--checkpoint_dir: checkpoint {step_dir} holds a non-finite parameter or optimizer "
        f"moment; it was left as it is: move it away to resume from an earlier one"
      )
    return restored["state"]

  @staticmethod
  def _check_compatible(step_dir: pathlib.Path, abstract_state: TrainState) -> None:
    """Refuse a checkpoint whose arrays differ from the model's in name, shape or dtype
    from its metadata, before any array is read: a restore that fails part-way leaves
    orbax's reads pending on an event loop that is then closed, and each prints a
    traceback when tensorstore completes it."""
    handler = ocp.StandardCheckpointHandler()
    try:
      saved = ocp.tree.to_flat_dict(handler.metadata(epath.Path(step_dir / "state")), sep=".")
    except Exception as e:  # pylint: disable=broad-except
      raise UserInputError(
        f"--checkpoint_dir: checkpoint {step_dir} cannot be read ({type(e).__name__}: "
        f"{_first_line(e)}); it was left as it is: move it away to resume from an earlier one"
      ) from e
    finally:
      handler.close()
    wanted = ocp.tree.to_flat_dict(abstract_state, sep=".")
    problem = ""
    for name in sorted(set(saved) | set(wanted)):
      if name not in saved or name not in wanted:
        problem = f"{name} is {'missing from it' if name in wanted else 'not in the model'}"
      elif tuple(saved[name].shape) != tuple(wanted[name].shape):
        problem = (
          f"{name} has shape {tuple(saved[name].shape)}, the model's is {tuple(wanted[name].shape)}"
        )
      elif np.dtype(saved[name].dtype) != np.dtype(wanted[name].dtype):
        problem = f"{name} is {saved[name].dtype}, the model's is {wanted[name].dtype}"
      if problem:
        raise UserInputError(
          f"--checkpoint_dir: checkpoint {step_dir} cannot be restored into this model "
          f"({problem}); it was left as it is: move it away, or use the configuration it "
          f"was saved with"
        )

  def save(self, step: int, state: TrainState, batches: BatchSource, force: bool = False) -> bool:
    """Start saving `state` (after `step` steps) if the interval says so or `force`;
    raises NonFiniteState (saving nothing) if it holds a NaN or an infinity."""
    if not (force or self._manager.should_save(step)):
      return False
    if self._manager.latest_step() is not None and self._manager.latest_step() >= step:
      return False  # already saved (a stop right after an interval's save)
    if not is_finite(state):
      raise NonFiniteState(step)
    # Orbax waits for the previous save before starting one; once it has finished, its
    # files are final and can be fingerprinted.
    self._manager.wait_until_finished()
    self._write_manifests()
    self._rotate()
    args = {"state": ocp.args.StandardSave(state)}
    if batches.iterator is not None:
      import grain  # pylint: disable=import-outside-toplevel (token files only; optional)

      args["data"] = grain.checkpoint.CheckpointSave(batches.iterator)
    return self._manager.save(step, args=ocp.args.Composite(**args), force=force)

  def close(self) -> None:
    """Finish any save in flight and fingerprint it; the manager's threads are ended even
    when the save failed. Closing twice is harmless."""
    if self._closed:
      return
    self._closed = True
    try:
      self._manager.wait_until_finished()
      self._write_manifests()
      self._rotate()
    finally:
      self._manager.close()

  def _write_manifests(self) -> None:
    if jax.process_index() != 0:
      return
    for step in self._manager.all_steps():
      step_dir = self.directory / str(step)
      # Orbax renames a step's directory to its number once every file is final; a step
      # it tracks without that directory was not finalized (its save failed).
      if not step_dir.is_dir() or (step_dir / MANIFEST).exists():
        continue
      manifest = {
        name: {"bytes": (step_dir / name).stat().st_size, "sha256": _digest(step_dir / name)}
        for name in _files(step_dir)
      }
      partial = step_dir / PARTIAL_MANIFEST
      partial.write_text(json.dumps(manifest, indent=1))
      partial.rename(step_dir / MANIFEST)  # atomic: a manifest is whole or absent

  def _verify(self, step: int, step_dir: pathlib.Path) -> None:
    """Check this process's share of the files; all processes agree on the outcome."""
    problem = ""
    path = step_dir / MANIFEST
    if not path.exists():
      print(
        f"note: checkpoint {step_dir} has no manifest yet (the run stopped right after "
        f"saving it); restoring it unchecked"
      )
    else:
      try:
        manifest = json.loads(path.read_text())
      except ValueError:
        manifest, problem = {}, f"its manifest {path} is not valid JSON"
      names = sorted(manifest)
      for name in names[jax.process_index() :: jax.process_count()]:
        if problem:
          break
        file = step_dir / name
        if not file.exists():
          problem = f"{file} is missing"
        elif file.stat().st_size != manifest[name]["bytes"]:
          problem = (
            f"{file} has {file.stat().st_size} bytes, {manifest[name]['bytes']} were written"
          )
        elif _digest(file) != manifest[name]["sha256"]:
          problem = f"{file} differs from what was written (SHA-256 mismatch)"
    bad = np.int32(bool(problem))
    if jax.process_count() > 1:
      bad = np.max(multihost_utils.process_allgather(bad))
    if bad:
      where = problem or "a file checked by another process (see its error)"
      raise UserInputError(
        f"--checkpoint_dir: checkpoint {step_dir} is corrupted: {where}; "
        f"it was left as it is: move it away to resume from an earlier one"
      )


def _first_line(e: Exception) -> str:
  text = str(e).strip()
  return text.splitlines()[0] if text else ""
