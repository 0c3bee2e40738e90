"""Time one device's compiled program on a given piece of hardware.

Two streams, as on a GPU: a compute stream that runs the program's ops in schedule
order, and a communication stream that runs asynchronous collectives one after another.

  compute op       max(dot FLOPs / achievable matmul rate + other FLOPs / vector rate,
                       HBM bytes / achievable HBM bandwidth) + a kernel launch
  async collective starts when the compute stream reaches its start and the
                   communication stream is free; the compute stream only waits at its
                   done if the collective has not finished by then (exposed time)
  sync collective  as an async one whose done follows at once: it also waits for the
                   communication stream, since an in-flight collective holds the same
                   links, and the compute stream waits for all of it
  loop             its body's time times the trip count (a collective never spans an
                   iteration: start and done sit in the same body)

The step time is the compute stream's finish. Breakdown: compute_s (op time),
exposed_comm_s (waiting on collectives), other_s (kernel launches); memory_bound_s is the
part of compute_s spent in ops whose HBM traffic, not their FLOPs, sets their time.
`simulate` can also split exposed_comm_s by the collective waited for and where it runs
(`place`): "all-gather in step" waits outside every loop, "reduce-scatter in
pipeline_drain_reduce" inside the loop of that name scope.
"""

import dataclasses
import re
from collections.abc import Callable, Iterable

from hardware.catalog import Hardware
from projection import hlo

# Elementwise work runs on the CUDA cores, not the tensor cores. H100 SXM: 67 TFLOP/s
# FP32 against 989 dense BF16 (NVIDIA H100 datasheet), about 1/15.
VECTOR_FRACTION_OF_MATMUL = 1 / 15


@dataclasses.dataclass(frozen=True)
class StepCost:
  step_s: float
  compute_s: float
  exposed_comm_s: float
  other_s: float
  comm_s: float  # all collective time, hidden or not
  memory_bound_s: float  # of compute_s: ops whose bytes outlast their FLOPs

  def scaled(self, k: int) -> "StepCost":
    return StepCost(*(k * v for v in dataclasses.astuple(self)))

  def __add__(self, other: "StepCost") -> "StepCost":
    return StepCost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


ZERO = StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def matmul_tflops(hw: Hardware, dtype: str) -> float:
  """Achievable matmul rate for an op's element type."""
  if dtype.startswith("f4"):
    # NVFP4 (a block-scaled GEMM, model/block_scaled.py); only Blackwell compiles one.
    return hw.achievable_tflops("fp4") or hw.achievable_tflops("bf16")
  if dtype.startswith("f8"):
    return hw.achievable_tflops("fp8") or hw.achievable_tflops("bf16")
  if dtype == "f32":
    # GPUs run f32 dots as TF32 on the tensor cores at half the BF16 rate (H100 datasheet:
    # 495 vs 989 dense); a host profile has its own measured f32 rate.
    return hw.achievable_tflops("f32") or hw.achievable_tflops("bf16") / 2
  return hw.achievable_tflops("bf16")


def op_times_s(op: hlo.Compute, hw: Hardware) -> tuple[float, float]:
  """(FLOP time, HBM time) of one op; it takes the longer of the two."""
  matmul = matmul_tflops(hw, op.dot_dtype or op.dtype) * 1e12
  vector = (
    hw.achievable_tflops("f32") or hw.achievable_tflops("bf16") * VECTOR_FRACTION_OF_MATMUL
  ) * 1e12
  flops_s = op.dot_flops / matmul + (op.flops - op.dot_flops) / vector
  bytes_s = (op.bytes_read + op.bytes_written) / (hw.hbm_achievable_tb_s * 1e12)
  return flops_s, bytes_s


def op_time_s(op: hlo.Compute, hw: Hardware) -> float:
  return max(op_times_s(op, hw))


# Transformations that wrap a name scope in an op_name path ("vmap(vmap(pipeline_fill))");
# jit(f) names a function, not a scope.
_WRAPPERS = re.compile(r"^(?:[a-z_]+\()+")


def place(loop: hlo.Loop | None) -> str:
  """Where a collective runs, for `simulate`'s exposed_at: "step" outside every loop, else
  the innermost loop's name scope, the op_name's last scope before "/while"
  ("jit(f)/vmap(vmap(pipeline_fill))/while" -> pipeline_fill), or "loop" where it has none."""
  if loop is None:
    return "step"
  parts = loop.op_name.split("/")
  last = parts[-2] if len(parts) > 1 and parts[-1] == "while" else ""
  if not last or last.startswith(("jit(", "pjit(")):
    return "loop"
  return _WRAPPERS.sub("", last).rstrip(")") or "loop"


def simulate(
  nodes: Iterable[hlo.Node],
  hw: Hardware,
  collective_s: Callable[[hlo.Collective], float],
  trip_s: dict[str, float] | None = None,
  exposed_at: dict[str, float] | None = None,
  where: str = "step",
  runs: int = 1,
) -> StepCost:
  """The program's cost; with `trip_s`, each loop's time per trip is written there by the
  loop's name (what projection/step_loops.py's bubble_s reads of the same simulation);
  with `exposed_at`, the exposed time is added there by "<collective kind> in <place>",
  summing to exposed_comm_s. `where` and `runs`: the place of `nodes` and how many times a
  step runs them (a loop body's trips, outer loops' included)."""
  launch_s = hw.kernel_launch_us * 1e-6

  def waited(node: hlo.Collective, seconds: float) -> None:
    if exposed_at is not None and seconds > 0:
      key = f"{node.kind} in {where}"
      exposed_at[key] = exposed_at.get(key, 0.0) + seconds * runs

  now = comm_free = 0.0
  compute = exposed = other = comm = memory_bound = 0.0
  pending: dict[str, tuple[float, hlo.Collective]] = {}  # async collective -> its finish
  total = ZERO
  for node in nodes:
    if isinstance(node, hlo.Compute):
      flops_s, bytes_s = op_times_s(node, hw)
      duration = max(flops_s, bytes_s)
      now += duration + launch_s
      compute += duration
      memory_bound += duration if bytes_s > flops_s else 0.0
      other += launch_s
    elif isinstance(node, hlo.Collective):
      duration = collective_s(node)
      comm += duration
      begin = max(now, comm_free)
      comm_free = begin + duration
      if node.is_async and not node.xla_sync:
        pending[node.name] = (comm_free, node)
      else:
        exposed += comm_free - now
        waited(node, comm_free - now)
        now = comm_free
    elif isinstance(node, hlo.AsyncDone):
      finish, started = pending.pop(node.start, (now, None))
      if finish > now:
        exposed += finish - now
        waited(started, finish - now)
        now = finish
    elif isinstance(node, hlo.Loop):
      trip = simulate(
        node.body, hw, collective_s, trip_s, exposed_at, place(node), runs * node.trip_count
      )
      if trip_s is not None:
        trip_s[node.name] = trip.step_s
      body = trip.scaled(node.trip_count)
      total = total + body
      now += body.step_s
      comm_free = max(comm_free, now)
  return total + StepCost(now - total.step_s, compute, exposed, other, comm, memory_bound)
