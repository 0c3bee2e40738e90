"""launch.py as a user runs it (the default experiment, the results file, one bad input
per route to the user) and its modes' refusals of bad input, in-process."""

import glob
import json
import os
import signal
import struct
import subprocess
import sys

import jax
import pytest
from tensorboardX.proto import event_pb2

import experiments
from errors import UserInputError
from measure.point import build_point
from modes import options as options_lib
from parallelism import mesh as mesh_lib
from train import hooks as hooks_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  return subprocess.run(
    [sys.executable, "launch.py", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def _events(log_dir: str) -> dict[str, list[tuple[int, float]]]:
  """Scalars of a TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
  (path,) = glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
  scalars, data = {}, open(path, "rb").read()
  while data:
    (length,) = struct.unpack("<Q", data[:8])
    event = event_pb2.Event.FromString(data[12 : 12 + length])
    data = data[12 + length + 4 :]
    for value in event.summary.value:
      scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_default_experiment_trains_and_appends_a_record(tmp_path):
  out = launch(f"--output_dir={tmp_path}", "--steps=3", "--profile_steps=3:5")
  assert out.returncode == 0, out.stderr
  assert "2 nodes x 4" in out.stdout and "NVLink" in out.stdout and "InfiniBand" in out.stdout
  assert "MFU" in out.stdout and "Traceback" not in out.stderr
  assert "cuda" not in out.stderr.lower()
  (record,) = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
  for key in (
    "mode",
    "experiment",
    "model",
    "params",
    "devices",
    "nodes",
    "mesh",
    "global_batch",
    "seq_len",
    "compile_s",
    "step_time_s",
    "step_time_p90_s",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "model_tflops_per_device",
    "peak_tflops_per_device",
    "mfu",
    "losses",
  ):
    assert key in record, key
  assert record["devices"] == 8 and record["nodes"] == 2
  assert record["mesh"] == {
    "data": 2,
    "fsdp": 2,
    "expert": 1,
    "context": 1,
    "tensor": 2,
    "pipeline": 1,
  }
  assert len(record["losses"]) == 3 + 2  # timed steps plus the untimed warm-up steps
  assert 0 < record["mfu"] < 1
  scalars = _events(record["tensorboard_dir"])
  assert set(scalars) == {
    "train/loss",
    "train/learning_rate",
    "perf/step_time_s",
    "perf/tokens_per_s",
    "perf/mfu",
  }
  assert [step for step, _ in scalars["train/loss"]] == list(range(5))
  assert [loss for _, loss in scalars["train/loss"]] == pytest.approx(record["losses"])
  (trace,) = glob.glob(os.path.join(record["profile_dir"], "plugins/profile/*/*.xplane.pb"))
  assert os.path.getsize(trace) > 0


def test_benchmark_on_fewer_devices_with_overrides(tmp_path):
  out = launch(
    f"--output_dir={tmp_path}",
    "--mode=benchmark",
    "--devices=2",
    "--steps=2",
    "--set",
    "model.num_layers=1",
    "--set",
    "mesh.fsdp=1",
    "--set",
    "mesh.tensor=1",
  )
  assert out.returncode == 0, out.stderr
  (record,) = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
  assert record["mode"] == "benchmark" and "losses" not in record
  assert record["mesh"] == {
    "data": 2,
    "fsdp": 1,
    "expert": 1,
    "context": 1,
    "tensor": 1,
    "pipeline": 1,
  }


def test_list_names_every_experiment():
  out = launch("--list")
  assert out.returncode == 0
  for name in ("tiny", "gpt3", "cpu_char", "cpu_gpt2_small"):
    assert name in out.stdout


def _experiment(*sets: str, name: str = "tiny") -> experiments.ExperimentConfig:
  return options_lib.experiment(options_lib.Options(experiment=name, sets=sets), "train")


def _plan(*sets: str) -> None:
  mesh_lib.plan(_experiment(*sets).mesh, 8)


def _build(*sets: str, name: str = "tiny") -> None:
  build_point(_experiment(*sets, name=name), jax.devices())


# Each refusal as launch.py's modes meet it, in-process: the configuration (overrides.apply
# and the configs' validate), the mesh (mesh.plan over launch's 8 devices), the point's
# checks before it compiles, the paths and the projection points.
@pytest.mark.parametrize(
  "refuse, message",
  [
    (lambda: _experiment(name="nope"), "--experiment must be one of"),
    (lambda: _experiment("model.num_layer=4"), "unknown key 'num_layer'"),
    (lambda: _experiment("model.num_layers=four"), "model.num_layers: expected int"),
    (lambda: _experiment("model.remat=some"), "model.remat must be one of"),
    (lambda: _experiment("model=gpt3-9b"), "model must be one of"),
    (lambda: _experiment("mesh.tensor"), "--set expects KEY=VALUE"),
    (lambda: _plan("mesh.data=3"), "must equal the 8 devices"),
    (lambda: _plan("mesh.fsdp=1", "mesh.tensor=8"), "does not fit in the NVLink domain"),
    (
      lambda: _build("model.num_heads=3", "model.head_dim=16"),
      "model.num_heads = 3 does not divide",
    ),
    (
      lambda: _build("model.vocab_multiple=1", "model.vocab_size=255"),
      "padded model.vocab_size = 255",
    ),
    (lambda: _build("train.global_batch=6"), "train.global_batch = 6 does not divide"),
    (lambda: _build("mesh.fsdp=4", "mesh.tensor=2", name="gpt3"), "model: gpt3-175b needs"),
    (lambda: _build("model.attention=cudnn"), "model.attention=cudnn runs on NVIDIA GPUs only"),
    (lambda: _experiment("train.beta1=2"), "train.beta1 must be a finite number in [0, 1)"),
    (lambda: _experiment("train.learning_rate=inf"), "train.learning_rate must be a finite number"),
    (lambda: hooks_lib.parse_profile_steps("4:2", 12), "--profile_steps must be A:B"),
    (lambda: hooks_lib.parse_profile_steps("\u00b2:3", 12), "--profile_steps must be A:B"),
    (lambda: experiments.sweep("cpu_gpt2_small"), "no sweep is defined"),
    (lambda: options_lib.check_paths(options_lib.Options(output_dir="")), "--output_dir: empty"),
    (
      lambda: options_lib.check_paths(options_lib.Options(checkpoint_dir="")),
      "--checkpoint_dir: empty",
    ),
    (lambda: options_lib.projection_points(options_lib.Options(gpus=())), "--gpus: empty"),
    (
      lambda: options_lib.projection_points(options_lib.Options(gpus=("\u00b2",))),
      "--gpus takes positive whole numbers",
    ),
  ],
)
def test_bad_input_is_refused_naming_the_field(refuse, message):
  with pytest.raises(UserInputError) as refused:
    refuse()
  assert message in str(refused.value) and "\n" not in str(refused.value)


# One launch.py start-up per way bad input reaches the user, each one line and exit 2
# with nothing written: absl's flag parsing, the platform set-up before jax starts (the
# device count, the multi-process flags) and a UserInputError raised by a mode.
@pytest.mark.parametrize(
  "args, message",
  [
    (["--mode=fly"], "--mode"),
    (["--devices=999999"], "--devices: at most 4,096"),
    (
      ["--coordinator_address=127.0.0.1", "--num_processes=2", "--process_id=0"],
      "--coordinator_address must be HOST:PORT",
    ),
    (["--set", "model.num_layer=4"], "unknown key 'num_layer'"),
    (["--gpus=-4"], "--gpus: for the project, search and sweep modes"),
  ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
  out = launch(f"--output_dir={tmp_path}", *args)
  assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1, out.stderr
  assert message in lines[0]
  assert not (tmp_path / "results.jsonl").exists()


def test_ctrl_c_while_compiling_is_one_line_and_exit_130(tmp_path):
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR")
  }
  env["PYTHONUNBUFFERED"] = "1"
  # Ctrl-C as a terminal delivers it: a test run started in the background (`cmd &` in a
  # script) ignores SIGINT, a child inherits that and Python then never handles it, so
  # a shim puts SIGINT back to its default and execs launch.py.
  shim = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
  )
  proc = subprocess.Popen(
    [sys.executable, "-c", shim, "launch.py", f"--output_dir={tmp_path}", "--steps=5"],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  for line in proc.stdout:  # the mesh is printed just before the step is built and compiled
    if line.startswith("Mesh:"):
      break
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  lines = err.strip().splitlines()
  assert proc.returncode == 130 and len(lines) == 1, (proc.returncode, err[-3000:])
  assert lines[0].startswith("stopped:") and "Traceback" not in err
  assert not (tmp_path / "results.jsonl").exists()
