"""What a crash at each phase of a save leaves behind, and a resume from it.

A save goes through phases, each of which a kill can interrupt: orbax writing the
step's files under `STEP.orbax-checkpoint-tmp`, finalizing them there (metadata, commit
marker), renaming the directory to `STEP`, then this repo writing the step's manifest
(`manifest.sha256.json.partial`, renamed), and orbax rotating out the oldest step. Each
test below lays out on disk exactly what a kill in one phase leaves - built from a real
uninterrupted run's checkpoints, so the files are orbax's own - resumes, and requires
the final state to equal the uninterrupted run's bit for bit.

Exact equality is valid here: the resumed and the uninterrupted run execute the same
compiled program on the same single CPU device, from a state restored byte for byte,
on batches that are a pure function of (seed, step) (the learnable task); XLA on one
CPU device reduces in a fixed order, so nothing is left to differ.

The runs are in-process on one device (one quick compile, cached for the module).
"""

import dataclasses
import os
import shutil

import jax
import numpy as np
import pytest
import small_models

import experiments
from errors import RunStopped
from experiments import overrides
from train import checkpoint, loop
from train.checkpoint import MANIFEST, PARTIAL_MANIFEST, TMP_SUFFIX, Checkpoints

TOTAL = 6  # steps, no warm-up: checkpoints 1 .. 6 with a save every step


@pytest.fixture(scope="module")
def exp():
  return overrides.apply(
    experiments.load("tiny"),
    [
      "model.num_layers=1",
      "train.task=learnable",
      f"train.steps={TOTAL}",
      "train.warmup_steps=0",
      "mesh.fsdp=1",
      "mesh.tensor=1",
    ],
  )


@pytest.fixture(scope="module")
def program(exp):
  return small_models.train_program(exp, 1)


@pytest.fixture(scope="module")
def reference(exp, program, tmp_path_factory):
  """An uninterrupted run that keeps every checkpoint: its directory and final state."""
  directory = str(tmp_path_factory.mktemp("reference"))
  result = loop.run(program, exp.model, exp.train, Checkpoints(directory, 1, 100))
  assert _steps(directory) == list(range(1, TOTAL + 1))
  return directory, result.final_state


def _steps(directory: str) -> list[int]:
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _bitwise_equal(a, b) -> bool:
  return all(
    np.array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def _files(step_dir: str) -> list[str]:
  return sorted(os.path.join(d, n) for d, _, names in os.walk(step_dir) for n in names)


def _copy(reference_dir: str, steps: list[int], directory: str) -> None:
  for step in steps:
    shutil.copytree(os.path.join(reference_dir, str(step)), os.path.join(directory, str(step)))


def _as_temporary(reference_dir: str, step: int, directory: str, keep_fraction: float) -> None:
  """Step `step` under orbax's temporary names with only part of its files: orbax's
  writing (fraction < 1) or finalizing (the files complete, not yet renamed)."""
  tmp = os.path.join(directory, f"{step}{TMP_SUFFIX}")
  shutil.copytree(os.path.join(reference_dir, str(step)), tmp)
  os.remove(os.path.join(tmp, MANIFEST))
  os.remove(os.path.join(tmp, "commit_success.txt"))
  os.rename(os.path.join(tmp, "state"), os.path.join(tmp, f"state{TMP_SUFFIX}"))
  data = [f for f in _files(tmp) if "_CHECKPOINT_METADATA" not in f]
  for path in data[int(len(data) * keep_fraction) :]:
    os.remove(path)


def _crash_writing(reference_dir: str, directory: str) -> None:
  _copy(reference_dir, [2, 3, 4], directory)
  _as_temporary(reference_dir, 5, directory, keep_fraction=0.3)


def _crash_finalizing(reference_dir: str, directory: str) -> None:
  _copy(reference_dir, [2, 3, 4], directory)
  _as_temporary(reference_dir, 5, directory, keep_fraction=1.0)


def _crash_renaming(reference_dir: str, directory: str) -> None:
  """Renamed by orbax; killed while writing its manifest (a partial one left)."""
  _copy(reference_dir, [2, 3, 4, 5], directory)
  manifest = os.path.join(directory, "5", MANIFEST)
  text = open(manifest).read()
  os.remove(manifest)
  with open(os.path.join(directory, "5", PARTIAL_MANIFEST), "w") as f:
    f.write(text[: len(text) // 2])


def _crash_rotating(reference_dir: str, directory: str) -> None:
  """Step 5 finished; killed while the oldest (2) was being deleted."""
  _copy(reference_dir, [2, 3, 4, 5], directory)
  for path in _files(os.path.join(directory, "2"))[::2]:
    os.remove(path)


@pytest.mark.parametrize(
  "crash",
  [_crash_writing, _crash_finalizing, _crash_renaming, _crash_rotating],
  ids=["writing", "finalizing", "renaming", "rotating"],
)
def test_resume_after_a_crash_in_each_phase_of_a_save(crash, exp, program, reference, tmp_path):
  reference_dir, final_state = reference
  directory = str(tmp_path)
  crash(reference_dir, directory)
  resumed_from = max(_steps(directory))
  ckpt = Checkpoints(directory, 1, 3)
  assert not [n for n in os.listdir(directory) if TMP_SUFFIX in n]  # cleaned at the start
  result = loop.run(program, exp.model, exp.train, ckpt)
  assert result.first_step == resumed_from
  assert _bitwise_equal(result.final_state, final_state)
  # Everything kept is whole: each step's manifest lists exactly its files, all intact.
  assert _steps(directory)[-3:] == [4, 5, 6]
  reopened = Checkpoints(directory, 1, 3)
  try:
    for step in _steps(directory)[-3:]:
      reopened._verify(step, reopened.directory / str(step))  # pylint: disable=protected-access
      assert not os.path.exists(os.path.join(directory, str(step), PARTIAL_MANIFEST))
  finally:
    reopened.close()


def test_no_manifest_for_a_step_orbax_did_not_finalize(tmp_path, monkeypatch):
  """A save that failed leaves its step tracked by the manager with no directory."""
  ckpt = Checkpoints(str(tmp_path), 1, 3)
  monkeypatch.setattr(ckpt._manager, "all_steps", lambda: [7])  # pylint: disable=protected-access
  ckpt.close()  # writes the manifests of finalized steps: none here
  assert not os.path.exists(tmp_path / "7")


class _Poisoned:
  """`program` whose step, at step `at`, returns Adam moments of NaN: the loss of that
  step and the next is still finite, the state is not."""

  def __init__(self, program, at: int):
    self._program, self._at = program, at

  def __getattr__(self, name):
    return getattr(self._program, name)

  def lower(self, *args):
    compiled = self._program.lower(*args).compile()
    at = self._at

    class Lowered:  # pylint: disable=too-few-public-methods
      def compile(self):
        def step(state, batch):
          state, metrics = compiled(state, batch)
          if int(state.step) == at + 1:
            state = state._replace(
              opt_state=jax.tree.map(
                lambda x: x * np.nan if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact) else x,
                state.opt_state,
              )
            )
          return state, metrics

        return step

    return Lowered()


def test_a_non_finite_state_is_never_saved_and_the_good_ones_stay(exp, program, tmp_path):
  directory = str(tmp_path)
  first = dataclasses.replace(exp.train, steps=3)
  loop.run(program, exp.model, first, Checkpoints(directory, 1, 3))
  before = {step: _files(os.path.join(directory, str(step))) for step in _steps(directory)}
  assert list(before) == [1, 2, 3]
  with pytest.raises(RunStopped, match="non-finite parameter or optimizer moment") as error:
    loop.run(_Poisoned(program, at=3), exp.model, exp.train, Checkpoints(directory, 1, 3))
  assert error.value.exit_code == 1
  assert "newest checkpoint is step 3" in str(error.value)
  # Nothing saved from the bad state, nothing rotated out for it.
  assert {s: _files(os.path.join(directory, str(s))) for s in _steps(directory)} == before


def test_a_non_finite_checkpoint_is_refused_on_restore(exp, program, tmp_path):
  directory = str(tmp_path)
  ckpt = Checkpoints(directory, 1, 3)
  state = program.init()
  bad = state._replace(params=jax.tree.map(lambda x: x * np.inf, state.params))
  with pytest.raises(checkpoint.NonFiniteState):
    ckpt.save(1, bad, _NoBatches(), force=True)
  ckpt._manager.save(
    1,
    args=checkpoint.ocp.args.Composite(  # pylint: disable=protected-access
      state=checkpoint.ocp.args.StandardSave(bad)
    ),
    force=True,
  )
  ckpt.close()
  reopened = Checkpoints(directory, 1, 3)
  try:
    with pytest.raises(checkpoint.UserInputError, match="holds a non-finite parameter"):
      reopened.restore_latest(program.abstract_state, _NoBatches())
  finally:
    reopened.close()
  assert _steps(directory) == [1]  # left as it is


class _NoBatches:  # pylint: disable=too-few-public-methods
  iterator = None


def test_a_diverging_run_keeps_the_newest_good_checkpoint_and_resumes_from_it(
  exp, program, tmp_path
):
  """A learning rate of 1e30 leaves finite but ruined weights: the step run from them is
  NaN. With one checkpoint kept, rotation alone would delete the last good state."""
  directory = str(tmp_path)
  loop.run(
    program, exp.model, dataclasses.replace(exp.train, steps=3), Checkpoints(directory, 1, 1)
  )
  # The newest, and the newest known good: 3's own loss is not known until a step runs from it.
  assert _steps(directory) == [2, 3]
  good_files = _files(os.path.join(directory, "3"))
  diverging = overrides.apply(exp, ["train.learning_rate=1e30"])
  with pytest.raises(RunStopped, match=r"loss is nan at step (\d+)") as error:
    loop.run(
      small_models.train_program(diverging, 1),
      diverging.model,
      diverging.train,
      Checkpoints(directory, 1, 1),
    )
  bad = int(str(error.value).split(" at step ")[1].split(";")[0])
  # Step 3 trained fine (loss finite) and its update ruined the weights saved as bad.
  assert bad == 4
  assert _steps(directory) == [3, 4]  # the newest and, out of rotation, the newest good
  assert "newest known good step 3" in str(error.value)
  assert _files(os.path.join(directory, "3")) == good_files

  # A rerun resumes from the good one, setting the bad one aside (not deleting it).
  resumed = Checkpoints(directory, 1, 1)
  assert resumed.resume_step == 3
  resumed.close()
  assert _steps(directory) == [3]
  assert _steps(os.path.join(directory, checkpoint.SET_ASIDE, "1")) == [4]
  result = loop.run(program, exp.model, exp.train, Checkpoints(directory, 1, 1))
  assert result.first_step == 3
  # The resumed run is the uninterrupted one: same program, same restored state.
  assert _bitwise_equal(result.final_state, _reference_state(exp, program, tmp_path))


def _reference_state(exp, program, tmp_path):
  return loop.run(
    program, exp.model, exp.train, Checkpoints(str(tmp_path / "ref"), 1, 1)
  ).final_state


def test_resume_from_chooses_a_checkpoint_and_an_unknown_one_is_refused(exp, program, tmp_path):
  directory = str(tmp_path)
  loop.run(
    program, exp.model, dataclasses.replace(exp.train, steps=3), Checkpoints(directory, 1, 3)
  )
  with pytest.raises(checkpoint.UserInputError, match="no checkpoint of step 7 .* it has: 1, 2, 3"):
    Checkpoints(directory, 1, 3, resume_from=7)
  assert _steps(directory) == [1, 2, 3]  # nothing moved by a refused choice
  chosen = Checkpoints(directory, 1, 3, resume_from=2)
  state = chosen.restore_latest(program.abstract_state, _NoBatches())
  chosen.close()
  assert int(state.step) == 2
  assert _steps(directory) == [1, 2]


@pytest.mark.parametrize(
  "losses, resume_from, expected",
  [
    ({}, None, 5),  # no record: the newest, as checkpoints without one always were
    ({4: {"loss": 2.0, "good": True}, 5: {"loss": float("nan"), "good": False}}, None, 4),
    ({3: {"loss": 2.0, "good": True}, 4: {"loss": 9e9, "good": False}}, None, 5),
    ({5: {"loss": float("nan"), "good": False}}, 5, 5),  # asked for: taken as asked
  ],
)
def test_the_resume_step_is_the_newest_not_known_bad(losses, resume_from, expected):
  assert checkpoint.choose_resume_step([3, 4, 5], losses, resume_from)[0] == expected


def test_every_checkpoint_known_bad_is_refused():
  bad = {s: {"loss": float("inf"), "good": False} for s in (1, 2)}
  with pytest.raises(checkpoint.UserInputError, match="--resume_from=STEP"):
    checkpoint.choose_resume_step([1, 2], bad, None)


def test_a_loss_jump_beyond_the_factor_stops_only_when_asked():
  assert loop._loss_problem(50.0, 5.0, 0.0) == ""  # pylint: disable=protected-access
  assert loop._loss_problem(50.0, 5.0, 20.0) == ""  # pylint: disable=protected-access
  assert "jumped" in loop._loss_problem(50.0, 5.0, 5.0)  # pylint: disable=protected-access
  assert "nan" in loop._loss_problem(float("nan"), 5.0, 0.0)  # pylint: disable=protected-access
