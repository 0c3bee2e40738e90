"""Bad input at the boundary: one line naming the field, exit 2, nothing written or lost.

Property-based (hypothesis) over `--set` values, mesh sizes, optimizer values and token
file contents, in-process: the contract is that each input either works or raises
UserInputError with a one-line message that names the field, and that nothing under the
output or checkpoint directory changes. One subprocess case per contract checks what a
user sees (one line on stderr, exit 2, no traceback). Also: results.jsonl after a
killed writer, sweeps resumed past bad lines, tools/make_tokens.py, a Ctrl-C without
--checkpoint_dir.
"""

import json
import math
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import experiments
from errors import RunStopped, UserInputError
from experiments import overrides
from parallelism import mesh as mesh_lib
from report import results
from sweep import runner
from sweep.definitions import Sweep
from tools import make_tokens
from train import loop, token_data
from train import step as train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# derandomize: the same examples on every machine and run, so a landing cannot fail at
# random; a wider search is a run with more examples (benchmarks are not needed for it).
FUZZ = settings(
  max_examples=60,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.function_scoped_fixture],
)
TINY = experiments.load("tiny")

# Text a hurried user types: numbers of every form, unicode digits, floats, words.
_NUMBERISH = st.one_of(
  st.integers(-(10**12), 10**12).map(str),
  st.floats(allow_nan=True, allow_infinity=True).map(repr),
  st.sampled_from(
    [
      "",
      " ",
      "inf",
      "-inf",
      "nan",
      "1e999",
      "²",
      "٣",
      "1_000",
      "0x10",
      "1.5",
      "true",
      "none",
      "-1",
      "0",
      "4" * 5000,
      "\x00",
      "1,2",
    ]
  ),
  st.text(max_size=8),
)
_SETTABLE = [
  f"{group}.{f}"
  for group, cfg in (("model", TINY.model), ("train", TINY.train), ("mesh", TINY.mesh))
  for f in cfg.__dataclass_fields__
  if f != "name"
]
_SETTABLE += list(overrides.SHORTCUTS)


def _one_line_naming(error: UserInputError, *names: str) -> None:
  text = str(error)
  assert text and "\n" not in text, text
  assert any(n in text for n in names), (names, text)


def _validated(assignments: list[str]):
  exp = overrides.apply(TINY, assignments)
  exp.model.validate()
  exp.train.validate()
  mesh_lib.plan(exp.mesh, 8)
  return exp


@FUZZ
@given(key=st.sampled_from(_SETTABLE), value=_NUMBERISH)
def test_any_set_value_works_or_is_refused_naming_the_field(key, value):
  try:
    exp = _validated([f"{key}={value}"])
  except UserInputError as e:
    field = key.split(".")[-1]
    _one_line_naming(e, field, "mesh", "model", "--set")
    return
  # Accepted: every number that reaches training is finite.
  for cfg in (exp.model, exp.train, exp.mesh):
    for name in cfg.__dataclass_fields__:
      value = getattr(cfg, name)
      if isinstance(value, float):
        assert math.isfinite(value), (key, name, value)


@FUZZ
@given(
  field=st.sampled_from(
    ["learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip", "min_lr_ratio"]
  ),
  value=st.floats(allow_nan=True, allow_infinity=True),
)
def test_optimizer_values_that_cannot_train_are_refused(field, value):
  try:
    _validated([f"train.{field}={value!r}"])
  except UserInputError as e:
    _one_line_naming(e, f"train.{field}")
    return
  assert math.isfinite(value) and value >= 0
  if field in ("beta1", "beta2"):
    assert value < 1
  if field in ("learning_rate", "eps", "grad_clip"):
    assert value > 0


@FUZZ
@given(
  sizes=st.lists(st.integers(-3, 9), min_size=4, max_size=4),
  devices=st.integers(1, 64),
  per_node=st.integers(-2, 16),
)
def test_mesh_plan_works_or_is_refused_naming_mesh(sizes, devices, per_node):
  cfg = mesh_lib.MeshConfig(*sizes, devices_per_node=per_node)
  try:
    layout = mesh_lib.plan(cfg, devices)
  except UserInputError as e:
    _one_line_naming(e, "mesh")
    return
  assert layout.devices == devices


def _token_file(directory, content: bytes, meta) -> str:
  path = os.path.join(directory, "t.bin")
  with open(path, "wb") as f:
    f.write(content)
  if meta is not None:
    with open(f"{path}.json", "w") as f:
      f.write(meta)
  return path


_META = st.one_of(
  st.none(),
  st.just('{"dtype": "uint16", "vocab_size": 256, "tokens": '),  # cut short
  st.builds(
    lambda v, n, d: json.dumps({"dtype": d, "vocab_size": v, "tokens": n}),
    st.one_of(st.integers(-5, 70000), st.text(max_size=3), st.none()),
    st.integers(0, 600),
    st.sampled_from(["uint16", "uint8"]),
  ),
  st.text(max_size=20),
)


@FUZZ
@given(content=st.binary(max_size=600), meta=_META, vocab=st.integers(1, 70000))
def test_token_files_work_or_are_refused_by_name(tmp_path, content, meta, vocab):
  path = _token_file(str(tmp_path), content, meta)
  before = sorted(os.listdir(tmp_path))
  try:
    tokens = token_data.check_file(path, vocab)
  except UserInputError as e:
    _one_line_naming(e, "train.data_path", "model.vocab_size")
  else:
    assert len(content) % 2 == 0 and len(content) > 0
    assert int(np.max(tokens)) < vocab
    del tokens
  assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize(
  "content, meta, message",
  [
    (b"", None, "is empty"),
    (b"abc", None, "not a whole number"),
    (np.arange(10, dtype=np.uint16).tobytes(), '{"vocab_size": 256,', "cannot be read as JSON"),
    (np.arange(10, dtype=np.uint16).tobytes(), '{"tokens": 10}', "no positive whole vocab_size"),
    (
      np.arange(10, dtype=np.uint16).tobytes(),
      '{"vocab_size": 256, "tokens": 20}',
      "says 20 tokens",
    ),
    (np.array([1, 300], dtype=np.uint16).tobytes(), None, "token id 300"),
  ],
)
def test_bad_token_files_are_named(tmp_path, content, meta, message):
  with pytest.raises(UserInputError, match=message) as error:
    token_data.check_file(_token_file(str(tmp_path), content, meta), 256)
  _one_line_naming(error.value, "train.data_path")


# results.jsonl after a writer killed mid-line.


def test_append_after_a_partial_line_starts_a_new_one(tmp_path, capsys):
  path = tmp_path / "results.jsonl"
  path.write_text('{"a": 1}\n{"b": 2, "tru')
  results.append(str(tmp_path), {"c": 3})
  assert path.read_text() == '{"a": 1}\n{"b": 2, "tru\n{"c": 3}\n'  # nothing rewritten
  assert "partial line" in capsys.readouterr().err
  assert results.read(str(tmp_path)) == [{"a": 1}, {"c": 3}]
  warning = capsys.readouterr().err.strip().splitlines()
  assert len(warning) == 1 and "line 2" in warning[0]


def test_sweep_resumes_past_lines_that_are_not_records(tmp_path, capsys, monkeypatch):
  sweep = Sweep(mode="benchmark", counts=(1, 2), scalings=("configured",))
  measured = []

  def measure(exp, devices, options):
    measured.append(devices)
    return {"tokens_per_s_per_device": 1.0, "tokens_per_s": float(devices)}

  monkeypatch.setattr(runner, "_measure", measure)
  first = runner.run(TINY, sweep, str(tmp_path), "cpu")
  assert measured == [1, 2]
  with open(tmp_path / "results.jsonl", "a") as f:
    f.write('[1, 2]\n{"sweep_key": ["x"]}\n{"status": "ok"}\n{"sweep_key": "')
  again = runner.run(TINY, sweep, str(tmp_path), "cpu")
  assert measured == [1, 2]  # both points found despite the bad lines
  assert [r["sweep_key"] for r in again] == [r["sweep_key"] for r in first]
  err = capsys.readouterr().err
  assert "Traceback" not in err and "line 3 is not a JSON object" in err


# tools/make_tokens.py


def test_make_tokens_refuses_to_overwrite_its_input(tmp_path):
  notes = tmp_path / "notes.txt"
  notes.write_text("some notes")
  for output in (notes, tmp_path / "." / "notes.txt"):
    with pytest.raises(UserInputError, match="would overwrite the input"):
      make_tokens.make(str(notes), str(output))
  assert notes.read_text() == "some notes"
  described = tmp_path / "data.bin.json"  # the description written beside --output
  described.write_text("notes")
  with pytest.raises(UserInputError, match="would overwrite the input"):
    make_tokens.make(str(described), str(tmp_path / "data.bin"))
  assert described.read_text() == "notes"
  assert make_tokens.make(str(notes), str(tmp_path / "notes.bin")) == len("some notes")


def test_make_tokens_cli_is_one_line_and_exit_2(tmp_path):
  notes = tmp_path / "notes.txt"
  notes.write_text("some notes")
  out = subprocess.run(
    [sys.executable, "tools/make_tokens.py", f"--input={notes}", f"--output={notes}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1 and "overwrite the input" in lines[0], out.stderr
  assert notes.read_text() == "some notes"


# launch.py: one subprocess per contract.


def _launch(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, "launch.py"), *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )


def _tree(directory) -> dict:
  return {
    os.path.join(d, n): os.path.getsize(os.path.join(d, n))
    for d, _, names in os.walk(directory)
    for n in names
  }


def test_unusable_output_path_is_refused_before_training(tmp_path):
  out = tmp_path / "out"
  (out / "results.jsonl").mkdir(parents=True)
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "keep").write_text("x")
  before = _tree(tmp_path)
  done = _launch(
    f"--output_dir={out}",
    f"--checkpoint_dir={ckpt}",
    "--set",
    "train.learning_rate=nan",
    cwd=str(tmp_path),
  )
  lines = done.stderr.strip().splitlines()
  assert done.returncode == 2 and len(lines) == 1, done.stderr
  assert "results.jsonl is a directory" in lines[0] and "Mesh" not in done.stdout
  assert _tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["ckpt", "out"]


def test_ctrl_c_without_checkpoints_is_one_line(monkeypatch):
  exp = overrides.apply(
    TINY, ["model.num_layers=1", "mesh.fsdp=1", "mesh.tensor=1", "train.steps=50"]
  )
  layout = mesh_lib.plan(exp.mesh, 1)
  program = train_step.build(exp.model, exp.train, mesh_lib.build_mesh(layout, jax.devices()[:1]))

  class CtrlC:
    def before_step(self, step):
      pass

    def after_step(self, step, metrics, step_time_s):
      if step == 1:
        os.kill(os.getpid(), signal.SIGINT)

    def close(self):
      pass

  with pytest.raises(
    RunStopped, match=r"signal 2 after step 1; stopped \(no --checkpoint_dir"
  ) as error:
    loop.run(program, exp.model, exp.train, None, [CtrlC()])
  assert error.value.exit_code == 130
