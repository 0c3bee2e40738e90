"""kill -9 at random moments of a run that checkpoints every step; every restart must resume
and the final state must equal an uninterrupted run's bit for bit.

  python benchmarks/kill_stress.py --kills=50
  python benchmarks/kill_stress.py --kills=200 --steps=20 --seed=1
  python benchmarks/kill_stress.py --workload=llama_context --kills=100
  python benchmarks/kill_stress.py --workload=sweep --kills=20 --window_s=60

The `tiny` run is launch.py's tiny experiment with one layer on the byte-level Python
documentation corpus (so the data iterator's position is checkpointed too), on 8 CPU
devices, saving after every step; `llama_context` is the same with the Llama 3 tiny model
(rotary positions, grouped-query attention) over context 2 x FSDP 4. `sweep` is a projected
sweep (MLPerf GPT-3 175B on 512 H100, its 1F1B step composed from compiled pieces cached on
disk): a kill lands in a piece's compile, its cache write or a record's append, and the
finished sweep's records must equal an uninterrupted sweep's in every projected figure.

Each attempt starts the same command, waits until the
mesh is printed (JAX has started), then a random delay drawn uniformly from
[0, --window_s], and sends SIGKILL if the run is still going: the kill lands in a
restore, the compile, a step, or any phase of an asynchronous save. After at most
--kills_per_round kills the run is let finish, compared with the reference, and the
next round starts in a fresh directory. A failure is a restart that exits non-zero
without being killed, or a final state that differs from the reference in any bit.

Exact equality is the right test: the same program on the same 8 devices, restored
byte for byte, reads the same batches (the iterator's saved position) with the same
random numbers, so an interrupted and resumed run computes exactly what an
uninterrupted one does. Prints kills, failures and the time taken.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# pylint: disable=wrong-import-position
import platform_env

platform_env.configure(8)

import jax
import numpy as np
import orbax.checkpoint as ocp

import experiments
from experiments import overrides
from parallelism import mesh as mesh_lib
from tools import make_tokens
from train import step as train_step

# The trained workloads: (experiment, --set overrides besides the corpus).
TRAINED = {
  "tiny": ("tiny", ["model.num_layers=1"]),
  "llama_context": (
    "llama3",
    ["model=llama3-tiny", "model.num_layers=1", "mesh.context=2", "mesh.fsdp=4"],
  ),
}
SWEEP = ["--mode=sweep", "--experiment=mlperf_gpt3_175b", "--hardware=h100", "--gpus=512"]
# Fields of a projected record that a rerun may change without the projection changing.
VOLATILE = ("compile_s", "time", "cached", "composition_compile_s", "tensorboard_dir")


def _sets(workload: str, corpus: str) -> list[str]:
  return [*TRAINED[workload][1], "train.task=tokens", f"train.data_path={corpus}"]


def _command(workload: str, corpus: str, steps: int, ckpt: str, out: str) -> list[str]:
  launch = [sys.executable, os.path.join(ROOT, "launch.py"), f"--output_dir={out}"]
  if workload == "sweep":
    return [*launch, *SWEEP]
  sets = [a for s in _sets(workload, corpus) for a in ("--set", s)]
  return [
    *launch,
    f"--experiment={TRAINED[workload][0]}",
    f"--steps={steps - 2}",
    f"--checkpoint_dir={ckpt}",
    "--checkpoint_every=1",
    "--keep_checkpoints=2",
    *sets,
  ]


def _env(cache: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONUNBUFFERED"] = "1"
  # The sweep's composed pieces and XLA's kernels: a cache of this run's own, so the first
  # sweep compiles its pieces (and kills land in those compiles and their cache writes).
  env["JAX_SCALING_COMPOSE_CACHE"] = os.path.join(cache, "compose")
  env["JAX_SCALING_KERNEL_CACHE"] = os.path.join(cache, "kernels.bin")
  # Restarts load the compiled step from JAX's cache (as a rerun on a cluster would), so
  # the attempts spend their time in steps and saves rather than compiling.
  env["JAX_COMPILATION_CACHE_DIR"] = cache
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  return env


def _attempt(command: list[str], delay_s: float | None, log: str, cache: str) -> tuple[str, int]:
  """Run once; kill -9 `delay_s` after the mesh is printed, or after the start for a sweep
  (None: let it finish).
  Returns ('killed' | 'finished' | 'failed', exit code)."""
  with open(log, "w") as err:
    proc = subprocess.Popen(
      command, cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE, stderr=err, text=True
    )
    # A trained run's kill window starts once JAX has started (its mesh printed); a
    # sweep's at once (it prints no mesh).
    for line in proc.stdout if SWEEP[0] not in command else ():
      if line.startswith("Mesh:"):
        break
    if delay_s is not None:
      deadline = time.time() + delay_s
      while proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
      if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return "killed", proc.returncode
    proc.stdout.read()
    proc.wait()
  return ("finished" if proc.returncode == 0 else "failed"), proc.returncode


def _final_state(workload: str, corpus: str, ckpt: str, step: int):
  exp = overrides.apply(experiments.load(TRAINED[workload][0]), _sets(workload, corpus))
  layout = mesh_lib.plan(exp.mesh, 8)
  program = train_step.build(exp.model, exp.train, mesh_lib.build_mesh(layout, jax.devices()))
  with ocp.CheckpointManager(ckpt) as manager:
    args = ocp.args.Composite(state=ocp.args.StandardRestore(program.abstract_state))
    return manager.restore(step, args=args)["state"]


def _sweep_records(out: str) -> list[dict]:
  """The sweep's records in point order, without the fields a rerun may change."""
  records = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]
  kept = [{k: v for k, v in r.items() if k not in VOLATILE} for r in records]
  return sorted(kept, key=lambda r: json.dumps(r, sort_keys=True))


def _result(workload: str, corpus: str, ckpt: str, steps: int):
  if workload == "sweep":
    return _sweep_records(ckpt + "_out")
  return _final_state(workload, corpus, ckpt, steps)


def _equal(a, b) -> bool:
  if isinstance(a, list):
    return a == b
  return all(
    np.array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kills", type=int, default=50)
  parser.add_argument("--steps", type=int, default=12, help="steps per run, warm-up included")
  parser.add_argument(
    "--window_s",
    type=float,
    default=4.0,
    help="kill moments: uniform in [0, window_s] after JAX has started",
  )
  parser.add_argument(
    "--kills_per_round",
    type=int,
    default=10,
    help="then the run is let finish and compared; a new round starts",
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workload", choices=[*TRAINED, "sweep"], default="tiny")
  args = parser.parse_args()
  rng = random.Random(args.seed)
  work = tempfile.mkdtemp(prefix="kill-stress-")
  corpus = os.path.join(work, "python_docs.bin")
  make_tokens.make(make_tokens.PYTHON_DOCS, corpus)
  start = time.time()

  ref = os.path.join(work, "reference")
  cache = os.path.join(work, "jax_cache")
  outcome, code = _attempt(
    _command(args.workload, corpus, args.steps, ref, ref + "_out"),
    None,
    os.path.join(work, "reference.log"),
    cache,
  )
  assert outcome == "finished", f"the uninterrupted run failed ({code}): see {work}"
  reference = _result(args.workload, corpus, ref, args.steps)
  if args.workload == "sweep":  # every round compiles its pieces anew
    shutil.rmtree(os.path.join(cache, "compose"), ignore_errors=True)

  kills = failures = rounds = 0
  while kills < args.kills:
    rounds += 1
    ckpt = os.path.join(work, f"round{rounds}")
    command = _command(args.workload, corpus, args.steps, ckpt, ckpt + "_out")
    kills_before = kills
    while True:
      in_round = kills - kills_before
      last = kills >= args.kills or in_round >= args.kills_per_round
      delay = None if last else rng.uniform(0, args.window_s)
      log = os.path.join(work, f"round{rounds}_attempt.log")
      outcome, code = _attempt(command, delay, log, cache)
      if outcome == "killed":
        kills += 1
        continue
      if outcome == "failed":
        failures += 1
        last = open(log).read().strip().splitlines()[-1:] or [""]
        print(f"round {rounds}: a restart failed (exit {code}): {last[0]}")
        shutil.copy(log, os.path.join(work, f"failure{failures}.log"))
        break
      if not _equal(_result(args.workload, corpus, ckpt, args.steps), reference):
        failures += 1
        print(f"round {rounds}: final result differs from the uninterrupted run's")
      if args.workload == "sweep":
        shutil.rmtree(os.path.join(cache, "compose"), ignore_errors=True)
      break
    print(
      f"round {rounds} done: {kills} kills so far, {failures} failures, {time.time() - start:.0f} s"
    )
    if failures == 0:
      shutil.rmtree(ckpt, ignore_errors=True)
  print(
    f"kills: {kills}  rounds: {rounds}  failures: {failures}  "
    f"time: {time.time() - start:.0f} s  ({args.workload}, steps per run {args.steps}, kill window "
    f"{args.window_s} s, seed {args.seed}; logs in {work})"
  )
  if failures == 0:
    shutil.rmtree(work, ignore_errors=True)
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  main()
