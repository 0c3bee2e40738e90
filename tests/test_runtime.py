"""Runs that survive: kills, SIGTERM, bad checkpoints, other device counts, 2 processes.

Every run trains a 1-layer GPT on a real corpus (the documentation topics that ship
with Python, byte-level tokens) through launch.py in subprocesses, so kills are real.
The runs are shared by the tests (module fixtures) to keep JAX start-ups few.
"""

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import small_models

import experiments
import platform_env
from errors import RunStopped, UserInputError
from experiments import overrides
from tools import make_tokens
from train import checkpoint, loop, token_data
from train.input_pipeline import BatchSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12  # 2 warm-up + 10: saved at 2, 4, ..., 12 (the newest 3 kept)
EVERY = 2
HEARTBEAT_S = 5
SETS = ["model.num_layers=1", "train.task=tokens"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
  path = str(tmp_path_factory.mktemp("corpus") / "python_docs.bin")
  make_tokens.make(make_tokens.PYTHON_DOCS, path)
  return path


def _args(corpus: str, ckpt: str, out: str) -> list[str]:
  sets = [a for s in SETS + [f"train.data_path={corpus}"] for a in ("--set", s)]
  return [
    f"--output_dir={out}",
    f"--steps={STEPS - 2}",
    f"--checkpoint_dir={ckpt}",
    f"--checkpoint_every={EVERY}",
    "--keep_checkpoints=3",
    *sets,
  ]


def _env(devices: int) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return env


def _start(args: list[str], devices: int = 8) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, "launch.py", *args],
    cwd=ROOT,
    env=_env(devices),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
  out, err = proc.communicate(timeout=timeout)
  return proc.returncode, out, err


def _saved_steps(ckpt: str) -> list[int]:
  """Finished checkpoints (orbax renames a step's directory to its number when done)."""
  if not os.path.isdir(ckpt):
    return []
  return sorted(int(n) for n in os.listdir(ckpt) if n.isdigit())


def _wait_for_checkpoint(ckpt: str, step: int, procs: list, timeout: float = 300) -> None:
  deadline = time.time() + timeout
  while not any(s >= step for s in _saved_steps(ckpt)):
    assert all(p.poll() is None for p in procs), "the run ended before the kill"
    assert time.time() < deadline, f"no checkpoint >= {step} within {timeout} s"
    time.sleep(0.02)


def _record(out: str) -> dict:
  return [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))][-1]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes(args: list[str], port: int) -> list[subprocess.Popen]:
  common = [
    f"--coordinator_address=127.0.0.1:{port}",
    "--num_processes=2",
    f"--heartbeat_timeout_s={HEARTBEAT_S}",
  ]
  return [_start([*args, *common, f"--process_id={i}"], devices=4) for i in range(2)]


def _exp(corpus: str) -> experiments.ExperimentConfig:
  return overrides.apply(experiments.load("tiny"), SETS + [f"train.data_path={corpus}"])


_program = small_models.train_program


def _state(experiment, ckpt: str, step: int):
  """Parameters and optimizer state saved at `step`, on 8 devices."""
  abstract = _program(experiment, 8).abstract_state
  with ocp.CheckpointManager(ckpt) as manager:
    return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))[
      "state"
    ]


def _bitwise_equal(a, b) -> bool:
  return all(
    np.array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
  """One uninterrupted 1 process x 8 devices run: its directory and record."""
  base = tmp_path_factory.mktemp("reference")
  ckpt, out = str(base / "ckpt"), str(base / "out")
  code, _, err = _finish(_start(_args(corpus, ckpt, out)))
  assert code == 0, err[-3000:]
  return ckpt, _record(out)


def test_real_text_loss_falls(reference):
  _, record = reference
  losses = record["losses"]
  assert len(losses) == STEPS
  # Uniform over 256 bytes is ln 256 = 5.55; byte frequencies alone bring it under 4.5.
  assert losses[0] > 5.0 and losses[-1] < losses[0] - 0.8, losses


def test_kill9_then_sigterm_resume_bit_for_bit(corpus, reference, tmp_path):
  ref_ckpt, ref_record = reference
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
  args = _args(corpus, ckpt, out)
  kill_after = random.choice([2, 4])

  proc = _start(args)
  _wait_for_checkpoint(ckpt, kill_after, [proc])
  proc.kill()  # SIGKILL, perhaps in the middle of the next save
  proc.wait()
  killed_at = _saved_steps(ckpt)[-1]

  proc = _start(args)
  _wait_for_checkpoint(ckpt, killed_at + EVERY, [proc])
  sent = time.time()
  proc.send_signal(signal.SIGTERM)
  code, _, err = _finish(proc)
  grace_s = time.time() - sent
  assert code == 128 + signal.SIGTERM, err[-3000:]
  stopped_after = int(err.split("signal 15 after step ")[1].split(";")[0])
  assert max(_saved_steps(ckpt)) == stopped_after + 1  # saved the step it stopped at
  assert grace_s < 30, grace_s  # Slurm's default grace: KillWait=30 s (slurm.conf man page)

  code, _, err = _finish(_start(args))
  assert code == 0, err[-3000:]
  record = _record(out)
  assert record["resumed_from_step"] == stopped_after + 1
  # The resumed steps saw the same batches and random numbers: identical losses ...
  assert record["losses"] == ref_record["losses"][stopped_after + 1 :]
  # ... and identical parameters and optimizer moments at the end.
  assert _bitwise_equal(_state(_exp(corpus), ckpt, STEPS), _state(_exp(corpus), ref_ckpt, STEPS))
  print(
    f"\nkill -9 after checkpoint {killed_at}; SIGTERM saved step {stopped_after + 1} "
    f"and exited in {grace_s:.1f} s"
  )


def test_two_processes_match_one_and_survive_a_kill(corpus, reference, tmp_path):
  """2 processes of 4 devices each, joined over loopback (gloo collectives), each using 2
  of its devices (`--devices` counts a process's own): 2 nodes x 2 devices."""
  _, ref_record = reference
  full_ckpt, full_out = str(tmp_path / "full"), str(tmp_path / "full_out")
  procs = _two_processes([*_args(corpus, full_ckpt, full_out), "--devices=2"], _free_port())
  for p in procs:
    code, _, err = _finish(p)
    assert code == 0, err[-3000:]
  record = _record(full_out)
  assert record["devices"] == 4 and record["nodes"] == 2
  # gloo's all-reduces and another device count sum in other orders than one process of
  # 8 devices: last-bit differences that a few float32 steps keep far below 1e-5 of the loss.
  np.testing.assert_allclose(record["losses"], ref_record["losses"], rtol=1e-5)

  # One process killed at a random step: the other exits with an error, in bounded time.
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
  args = [*_args(corpus, ckpt, out), "--devices=2"]
  procs = _two_processes(args, _free_port())
  victim = random.choice([0, 1])
  _wait_for_checkpoint(ckpt, random.choice([2, 4]), procs)
  procs[victim].kill()
  killed = time.time()
  survivor = procs[1 - victim]
  code, _, err = _finish(survivor, timeout=HEARTBEAT_S + 60)
  noticed_s = time.time() - killed
  procs[victim].wait()
  assert code != 0
  assert "JAX distributed service detected fatal errors" in err, err[-3000:]
  assert noticed_s < HEARTBEAT_S + 30, noticed_s

  resumed = max(_saved_steps(ckpt))
  procs = _two_processes(args, _free_port())
  for p in procs:
    code, _, err = _finish(p)
    assert code == 0, err[-3000:]
  assert _record(out)["resumed_from_step"] == resumed
  assert _bitwise_equal(_state(_exp(corpus), ckpt, STEPS), _state(_exp(corpus), full_ckpt, STEPS))
  print(
    f"\nprocess {victim} killed; process {1 - victim} exited {noticed_s:.1f} s later; "
    f"resumed from step {resumed}"
  )


def test_devices_a_process_lacks_are_refused_on_every_process(corpus, tmp_path):
  """A count some process lacks is refused on both, before any collective (a count each
  has: test_two_processes_match_one_and_survive_a_kill)."""
  out = str(tmp_path / "out")
  args = [a for a in _args(corpus, str(tmp_path / "ckpt"), out) if "checkpoint" not in a]
  procs = _two_processes([*args, "--devices=5"], _free_port())
  for p in procs:
    code, _, err = _finish(p, timeout=120)
    assert code == 2
    assert err.strip().splitlines()[-1] == "error: --devices must be at most 4 per process, got 5"
    assert "Traceback" not in err


def _copy_step(src: str, step: int, dst) -> str:
  shutil.copytree(os.path.join(src, str(step)), dst / str(step))
  return str(dst)


def test_restore_8_device_checkpoint_on_4_devices(corpus, reference, tmp_path):
  ref_ckpt, ref_record = reference
  step = STEPS - 2 * EVERY  # the oldest kept
  exp = _exp(corpus)
  program = _program(exp, 4)
  batches = BatchSource(exp.train, exp.model, program.batch_sharding)
  directory = _copy_step(ref_ckpt, step, tmp_path)
  with contextlib.closing(checkpoint.Checkpoints(directory, EVERY, 3)) as ckpt:
    state = ckpt.restore_latest(program.abstract_state, batches)
  assert int(state.step) == step
  leaf = jax.tree.leaves(state.params)[0]
  assert len(leaf.sharding.device_set) == 4
  _, metrics = program.step(state, batches.batch(step))
  # 4 devices reduce the batch in another order than 8: last-bit differences in the loss.
  np.testing.assert_allclose(float(metrics["loss"]), ref_record["losses"][step], rtol=1e-5)


def _corrupt(path: str, how: str) -> None:
  data = open(path, "rb").read()
  with open(path, "wb") as f:
    if how == "truncate":
      f.write(data[: len(data) // 2])
    else:
      f.write(
        data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :]
      )


def _largest_state_file(step_dir: str) -> str:
  files = [
    os.path.join(d, n) for d, _, names in os.walk(os.path.join(step_dir, "state")) for n in names
  ]
  return max(files, key=os.path.getsize)


@pytest.mark.parametrize("how", ["truncate", "alter"])
def test_corrupted_checkpoint_is_refused_by_name(corpus, reference, tmp_path, how):
  ref_ckpt, _ = reference
  directory = _copy_step(ref_ckpt, STEPS, tmp_path)
  bad = _largest_state_file(os.path.join(directory, str(STEPS)))
  _corrupt(bad, how)
  exp = _exp(corpus)
  program = _program(exp, 8)
  batches = BatchSource(exp.train, exp.model, program.batch_sharding)
  with contextlib.closing(checkpoint.Checkpoints(directory, EVERY, 3)) as ckpt:
    with pytest.raises(UserInputError, match="is corrupted") as error:
      ckpt.restore_latest(program.abstract_state, batches)
  assert bad in str(error.value)


def test_corrupted_checkpoint_exits_2_with_one_line(corpus, reference, tmp_path):
  ref_ckpt, _ = reference
  directory = _copy_step(ref_ckpt, STEPS - EVERY, tmp_path / "ckpt")
  _corrupt(_largest_state_file(os.path.join(directory, str(STEPS - EVERY))), "alter")
  args = _args(corpus, directory, str(tmp_path / "out"))
  code, _, err = _finish(_start(args))
  assert code == 2, err[-3000:]
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "is corrupted" in lines[0] and directory in lines[0], err[-3000:]
  assert _saved_steps(directory) == [STEPS - EVERY]  # nothing overwritten, no restart at 0


def test_incompatible_checkpoint_is_refused_by_name(corpus, reference, tmp_path):
  ref_ckpt, _ = reference
  directory = _copy_step(ref_ckpt, STEPS, tmp_path)
  exp = _exp(corpus)
  wider = overrides.apply(exp, ["model.d_model=128", "model.head_dim=32"])
  program = _program(wider, 8)
  batches = BatchSource(wider.train, wider.model, program.batch_sharding)
  with contextlib.closing(checkpoint.Checkpoints(directory, EVERY, 3)) as ckpt:
    with pytest.raises(UserInputError, match="cannot be restored") as error:
      ckpt.restore_latest(program.abstract_state, batches)
  assert os.path.join(directory, str(STEPS)) in str(error.value)


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good(tmp_path):
  exp = overrides.apply(
    experiments.load("tiny"),
    ["model.num_layers=1", "train.task=learnable", "train.learning_rate=1e30", "train.steps=3"]
    + ["mesh.fsdp=1", "mesh.tensor=1"],
  )
  program = _program(exp, 1)  # one device: the quickest compile
  ckpt = checkpoint.Checkpoints(str(tmp_path), 1, 3)
  with pytest.raises(RunStopped, match=r"loss is (nan|inf) at step \d+") as error:
    loop.run(program, exp.model, exp.train, ckpt)
  failed = int(str(error.value).split(" at step ")[1].split(";")[0])
  assert max(_saved_steps(str(tmp_path))) == failed  # the state before the bad step
  assert f"newest checkpoint is step {failed}" in str(error.value)


def test_distributed_flags_are_read_before_absl():
  dist = platform_env.distributed_from_argv(
    [
      "launch.py",
      "--coordinator_address=10.0.0.1:1234",
      "--num_processes=16",
      "--process_id=3",
      "--heartbeat_timeout_s=30",
      "--steps=5",
    ]
  )
  assert dist == platform_env.Distributed("10.0.0.1:1234", 16, 3, 30) and dist.from_flags
  assert not platform_env.distributed_from_argv(["launch.py", "--num_processes=x"]).from_flags


@pytest.mark.parametrize(
  "tasks, node, expected", [("1(x4)", "2", 1), ("8(x2),4", "2", 4), ("8,1", "1", 1)]
)
def test_one_process_per_node_is_recognised_under_slurm(monkeypatch, tasks, node, expected):
  monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
  monkeypatch.setenv("SLURM_TASKS_PER_NODE", tasks)
  monkeypatch.setenv("SLURM_NODEID", node)
  assert platform_env._tasks_on_this_node() == expected  # pylint: disable=protected-access


@pytest.mark.parametrize(
  "args, message",
  [
    (
      ["--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=2"],
      "--process_id must be in 0 .. --num_processes - 1 = 1, got 2",
    ),
    (["--num_processes=2"], "go together; got only --num_processes"),
  ],
)
def test_bad_distributed_flags_are_one_line_and_exit_2(args, message):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  out = subprocess.run(
    [sys.executable, "launch.py", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr


def test_each_process_reads_only_its_rows_of_one_global_order(corpus, monkeypatch):
  reads = []
  read = token_data.TokenWindows.__getitem__
  monkeypatch.setattr(
    token_data.TokenWindows, "__getitem__", lambda self, i: reads.append(i) or read(self, i)
  )

  def batches(rows, seed=0):
    return iter(token_data.local_batches(corpus, 64, 256, seed, 16, rows))

  def first(iterator, n=3):
    out = [next(iterator) for _ in range(n)]
    time.sleep(0.3)  # let the prefetch thread settle
    return out

  halves, read_by = [], []
  for rows in (range(0, 8), range(8, 16)):
    reads.clear()
    halves.append(first(batches(rows)))
    read_by.append(set(reads))
  assert read_by[0] and read_by[1] and not read_by[0] & read_by[1]  # disjoint records
  whole = first(batches(range(16)))
  for step in range(3):
    np.testing.assert_array_equal(np.concatenate([halves[0][step], halves[1][step]]), whole[step])
  assert not np.array_equal(first(batches(range(16), seed=1), 1)[0], whole[0])

  # The iterator's saved position brings a fresh iterator to the same next batch.
  iterator = batches(range(16))
  first(iterator, 2)
  resumed = batches(range(16))
  resumed.set_state(iterator.get_state())
  np.testing.assert_array_equal(next(resumed), whole[2])
