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
"""

import hashlib
import json
import os
import pathlib

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from errors import UserInputError
from train.input_pipeline import BatchSource
from train.step import TrainState

MANIFEST = "manifest.sha256.json"


def _digest(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _files(step_dir: pathlib.Path) -> list[str]:
  return sorted(
    str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST
  )


class Checkpoints:
  """Save every `every_steps` steps, keep the newest `keep`, resume from the newest."""

  def __init__(self, directory: str, every_steps: int, keep: int):
    if every_steps < 1:
      raise UserInputError(f"--checkpoint_every must be a positive integer, got {every_steps}")
    if keep < 1:
      raise UserInputError(f"--keep_checkpoints must be a positive integer, got {keep}")
    self.directory = pathlib.Path(os.path.abspath(directory))
    # Checked here: orbax would fail on it in a background thread, with a traceback.
    if self.directory.exists() and not self.directory.is_dir():
      raise UserInputError(f"--checkpoint_dir {self.directory} is a file, not a directory")
    # Orbax reports every stage of every save at INFO; warnings and errors still show.
    logging.set_verbosity(logging.WARNING)
    try:
      self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
          save_interval_steps=every_steps,
          max_to_keep=keep,
          enable_async_checkpointing=True,
          cleanup_tmp_directories=True,
          create=True,
        ),
      )
    except Exception as e:  # pylint: disable=broad-except
      raise UserInputError(
        f"--checkpoint_dir {self.directory} cannot be used: {type(e).__name__}: {_first_line(e)}"
      ) from e

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore_latest(self, abstract_state: TrainState, batches: BatchSource) -> TrainState | None:
    """The newest checkpoint onto `abstract_state`'s shardings (any mesh), the data
    iterator moved to its position; None when there is none."""
    step = self._manager.latest_step()
    if step is None:
      return None
    step_dir = self.directory / str(step)
    self._verify(step, step_dir)
    args = {"state": ocp.args.StandardRestore(abstract_state)}
    if batches.iterator is not None:
      args["data"] = grain.checkpoint.CheckpointRestore(batches.iterator)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**args))
    except Exception as e:  # pylint: disable=broad-except
      raise UserInputError(
        f"--checkpoint_dir: checkpoint {step_dir} cannot be restored "
        f"({type(e).__name__}: {_first_line(e)}); it was left as it is: "
        f"move it away to resume from an earlier one"
      ) from e
    return restored["state"]

  def save(self, step: int, state: TrainState, batches: BatchSource, force: bool = False) -> bool:
    """Start saving `state` (after `step` steps) if the interval says so or `force`."""
    if not (force or self._manager.should_save(step)):
      return False
    # Orbax waits for the previous save before starting one; once it has finished, its
    # files are final and can be fingerprinted.
    self._manager.wait_until_finished()
    self._write_manifests()
    args = {"state": ocp.args.StandardSave(state)}
    if batches.iterator is not None:
      args["data"] = grain.checkpoint.CheckpointSave(batches.iterator)
    return self._manager.save(step, args=ocp.args.Composite(**args), force=force)

  def close(self) -> None:
    """Finish any save in flight and fingerprint it."""
    self._manager.wait_until_finished()
    self._write_manifests()
    self._manager.close()

  def _write_manifests(self) -> None:
    if jax.process_index() != 0:
      return
    for step in self._manager.all_steps():
      step_dir = self.directory / str(step)
      if (step_dir / MANIFEST).exists():
        continue
      manifest = {
        name: {"bytes": (step_dir / name).stat().st_size, "sha256": _digest(step_dir / name)}
        for name in _files(step_dir)
      }
      partial = step_dir / f"{MANIFEST}.partial"
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
