"""The micro-benchmark programs a host profile is made of, and their run times on the
first N CPU devices (measure/host.py says why per active-device count).

The programs, so that the cost model (max(FLOPs / matmul rate, bytes / bandwidth) + a
per-op overhead; collectives by projection/collectives.py) fits the small ops of a CPU
step:
  - matmuls at a small GPT's dense-layer shapes ([m, k] @ [k, k2] @ [k2, k], e.g. 1024
    tokens x d_model 64 x 4 d_model), not a large GEMM's peak;
  - an elementwise op on 1 MiB slices of a stack, read and written as a layer scan does
    (a large copy would measure DRAM and page faults instead);
  - all-reduce and all-gather over groups of 2 and of all N devices at 4 KiB and 512 KiB
    (between CPU devices of one process a collective is a rendezvous plus memory copies);
  - an all-reduce of 8 operands against a one-operand one of the same bytes (XLA combines
    a step's small gradient all-reduces into one of up to ~26 operands, and XLA:CPU runs
    it as one rendezvous per operand);
  - a chain of tiny dependent ops (~1 us an op: the cost model's kernel launch);
  - a reference program: train steps of a small decoder written here (not the project's
    model: embeddings, attention, MLP, cross-entropy, AdamW), whose op mix (biases, norm
    scales, per-parameter optimizer updates) matches a small GPT step's: the bandwidth a
    step's own ops get is fitted to it.
Each program loops long enough (~20-40 ms, like a small model's step) that its fixed
cost per call is negligible. All programs run in interleaved rounds and each keeps its
median time: on a machine shared with other processes that is what a step of that length
sees (the minimum would be a quiet machine's figure, which loaded steps do not reach).
`MicroBenchmarks` runs the rounds one at a time, so that they can also be interleaved with
the steps they profile (a step hook: benchmarks/closing_the_loop.py), and the load that
other processes put on the cores falls on both alike.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

# Matmul shapes (m, k, k2), run as [m, k] @ [k, k2] @ [k2, k]: a small GPT's MLP at 1024
# and at 256 tokens (tokens x d_model 64 x 4 d_model), and a square one.
_FULL = dict(
  matmul_float32=((1024, 64, 256), (256, 64, 256), (256, 256, 256)),
  matmul_bfloat16=((256, 256, 256),),
  coll_kib=(4, 512),
  rounds=13,
)
_QUICK = dict(
  matmul_float32=((1024, 64, 256), (256, 256, 256)),
  matmul_bfloat16=((256, 256, 256),),
  coll_kib=(4, 512),
  rounds=5,
)
_MEMORY_KIB = 1024  # elementwise bandwidth on arrays of this size (per device)
_SCAN = 4  # slices in a scanned stack
_OPERANDS = 8  # operands of the multi-operand all-reduce


class MicroBenchmarks:
  """The micro-benchmark programs for `devices` active devices, run one round (one call of
  each program) at a time, so that they can be interleaved with the run they profile: as a
  train/loop.py step hook, a round runs before each step, outside the step's clock, and
  other processes' load falls on the profile and on the steps alike
  (benchmarks/closing_the_loop.py). `median_s()` is each program's median time over the
  rounds run since the last `reset()`."""

  def __init__(self, devices: int, quick: bool = False) -> None:
    import jax

    cpu = jax.devices("cpu")
    if devices > len(cpu):
      raise ValueError(
        f"a host profile for {devices} active devices needs {devices} CPU "
        f"devices; this process has {len(cpu)} (launch.py: --devices={devices})"
      )
    self.devices, self.quick = devices, quick
    self.cfg = _QUICK if quick else _FULL
    self.programs = Programs(cpu[:devices])
    self.programs.add_all(self.cfg)
    for fn, x in self.programs.jobs.values():  # warm-up
      jax.block_until_ready(fn(x))
    self.reset()

  def reset(self) -> None:
    self.times: dict[str, list[float]] = {name: [] for name in self.programs.jobs}
    self.started = time.perf_counter()

  def round(self) -> None:
    import jax

    for name, (fn, x) in self.programs.jobs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(x))
      self.times[name].append(time.perf_counter() - t0)

  def median_s(self) -> dict[str, float]:
    if not self.times["reference"]:
      raise RuntimeError("no profile round has run since the last reset")
    return {name: float(np.median(t)) for name, t in self.times.items()}

  # train/loop.py's StepHook: a round before each step.
  def before_step(self, step: int) -> None:
    self.round()

  def after_step(self, step: int, metrics: dict, step_time_s: float) -> None:
    pass

  def close(self) -> None:
    pass


class Programs:
  """The compiled micro-benchmark programs for n active devices and their inputs."""

  def __init__(self, devices: list) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    self.jax, self.jnp, self.n = jax, jnp, len(devices)
    # Mesh axes (other, group): collectives run over "g", in n / g groups at once.
    self.meshes = {
      g: Mesh(np.array(devices).reshape(self.n // g, g), ("o", "g"))
      for g in sorted({2, self.n})
      if self.n % g == 0
    }
    self.jobs: dict[str, tuple[Any, Any]] = {}  # name -> (compiled program, input)

  def per_device(self, fn: Callable, g: int | None = None) -> Callable:
    """`fn` on every active device at once (check_vma off: a psum's result stays local)."""
    from jax.sharding import PartitionSpec as P

    spec = P(("o", "g"))
    return self.jax.jit(
      self.jax.shard_map(
        fn, mesh=self.meshes[g or self.n], in_specs=spec, out_specs=spec, check_vma=False
      )
    )

  def local(
    self, shape: tuple[int, ...], dtype="float32", value: float = 1.0, g: int | None = None
  ):
    """An array of `shape` on each active device."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(self.meshes[g or self.n], P(("o", "g")))
    return self.jnp.full((self.n * shape[0], *shape[1:]), value, dtype, device=sharding)

  def add(self, name: str, program: Callable, x) -> None:
    self.jobs[name] = (program.lower(x).compile(), x)

  def add_repeated(self, name: str, body: Callable, x, repeats: int, g: int | None = None) -> None:
    """`body` (which keeps its argument's shape) `repeats` times in a loop."""
    loop = lambda v: self.jax.lax.fori_loop(0, max(1, repeats), lambda i, u: body(u), v)
    self.add(name, self.per_device(loop, g), x)

  def add_all(self, cfg: dict[str, Any]) -> None:
    jax, jnp, n = self.jax, self.jnp, self.n

    def chain(op: Callable, steps: int) -> Callable:
      def body(v):
        for _ in range(steps):
          v = op(v)
        return v

      return body

    def scan(op: Callable) -> Callable:  # a slice read, the op, the result written back
      return lambda v: jax.lax.scan(lambda c, row: (c, op(row)), 0.0, v[0])[1][None]

    # Tiny dependent dots (dots do not fuse), to take their overhead out of the rest.
    self.add_repeated(
      "tiny_ops", chain(lambda v: jnp.tanh(v @ v), 32), self.local((8, 8), value=0.1), 2048 // n
    )
    for dtype in ("float32", "bfloat16"):
      for m, k, k2 in cfg[f"matmul_{dtype}"]:
        w1, w2 = jnp.full((k, k2), 0.01, dtype), jnp.full((k2, k), 0.01, dtype)
        self.add_repeated(
          f"matmul_{dtype}/{m}x{k}x{k2}",
          scan(lambda row, w1=w1, w2=w2: row @ w1 @ w2),
          self.local((1, _SCAN, m, k), dtype),
          round(3e7 / (m * k * k2) / n),
        )
    self.add_repeated(
      "memory",
      scan(lambda row: row * 1.5 + 1.0),
      self.local((1, _SCAN, _MEMORY_KIB * 256)),
      48 // n,
    )
    for g in self.meshes if n > 1 else ():
      for kind, op in COLLECTIVES.items():
        for kib in cfg["coll_kib"]:
          elems = kib * 256 // g * g  # float32, a multiple of g: all-gather shards evenly
          x = self.local((elems if kind == "allreduce" else elems // g,), value=1.0 / g, g=g)
          # A small collective's latency grows about as n, a large one's time as 1 / n.
          self.add_repeated(
            f"{kind}/{g}/{kib}",
            chain(lambda v, op=op: op(jax, v), 8),
            x,
            512 // n**2 if kib < 64 else 64 // n,
            g,
          )
    if n > 1:
      # One all-reduce of _OPERANDS arrays, as XLA combines a step's small gradient
      # all-reduces, moving as many bytes as the smallest single all-reduce above. One
      # a loop iteration: XLA would run a chain of them in one body operand by operand.
      elems = cfg["coll_kib"][0] * 256 // _OPERANDS
      self.add_repeated(
        f"allreduce_operands/{n}",
        lambda v: jax.lax.psum(v, "g"),
        tuple(self.local((elems,), value=1.0 / n) for _ in range(_OPERANDS)),
        8 * 512 // n**2,
      )
    # Train steps of a small decoder on 1024 / n tokens per device.
    tokens = self.local((max(1, 1024 // n // 64), 64), "int32")
    self.add(
      "reference",
      self.per_device(
        lambda t: jax.lax.fori_loop(
          0,
          max(1, 4 // n),
          lambda i, state: _reference_step(jax, jnp, state, t),
          _reference_state(jnp),
        )["params"]["embed"]
      ),
      tokens,
    )


COLLECTIVES = {  # kind -> op over mesh axis "g"; measure/host_calibration.py fits them
  "allreduce": lambda jax, v: jax.lax.psum(v, "g"),
  # The first shard of the result is sliced out to chain the next one.
  "allgather": lambda jax, v: jax.lax.all_gather(v, "g", tiled=True)[: v.shape[0]],
}


def _reference_state(jnp) -> dict[str, Any]:
  """Parameters and Adam moments of the reference program: vocabulary 256, context 64,
  2 layers, d_model 64, 4 heads of 16, MLP 256, biases and norm scales."""
  shapes = {
    "embed": (256, 64),
    "position": (64, 64),
    "final_scale": (64,),
    "wqkv": (2, 64, 192),
    "bqkv": (2, 192),
    "wo": (2, 64, 64),
    "bo": (2, 64),
    "w1": (2, 64, 256),
    "b1": (2, 256),
    "w2": (2, 256, 64),
    "b2": (2, 64),
    "scale1": (2, 64),
    "scale2": (2, 64),
  }
  params = {name: jnp.full(shape, 0.02, jnp.float32) for name, shape in shapes.items()}
  zeros = {name: jnp.zeros(shape, jnp.float32) for name, shape in shapes.items()}
  return {"params": params, "m": zeros, "v": dict(zeros)}


def _reference_step(jax, jnp, state: dict[str, Any], tokens) -> dict[str, Any]:
  """One AdamW step, gradients clipped by global norm, of a small pre-LN decoder on
  tokens [batch, 64]: the kinds of op a small GPT's train step runs (embeddings, norms,
  dense layers, causal softmax attention, GELU, tied logits, cross-entropy, their
  gradients, a layer scan, the optimizer's per-parameter updates), written
  independently of model/gpt.py and train/."""

  def norm(h, scale):
    mean = h.mean(-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(jnp.square(h - mean).mean(-1, keepdims=True) + 1e-5) * scale

  def layer(h, p):
    b, t, _ = h.shape
    qkv = norm(h, p["scale1"]) @ p["wqkv"] + p["bqkv"]
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * 4, 16), 3, axis=2)
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / 4.0
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e30)
    attended = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(scores, axis=-1), v)
    h = h + attended.reshape(b, t, 64) @ p["wo"] + p["bo"]
    return h + jax.nn.gelu(norm(h, p["scale2"]) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], None

  def loss(p):
    layers = {name: w for name, w in p.items() if w.ndim > 1 and w.shape[0] == 2}
    h = jax.lax.scan(layer, p["embed"][tokens] + p["position"], layers)[0]
    logits = norm(h, p["final_scale"]) @ p["embed"].T
    targets = jnp.roll(tokens, -1, axis=1)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1).mean()

  grads = jax.grad(loss)(state["params"])
  norm_sq = sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))
  grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 1.0 / jnp.sqrt(norm_sq)), grads)
  m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["m"], grads)
  v = jax.tree.map(lambda v, g: 0.95 * v + 0.05 * g * g, state["v"], grads)
  params = jax.tree.map(
    lambda w, m, v: w - 1e-3 * (m / (jnp.sqrt(v) + 1e-8) + 0.1 * w), state["params"], m, v
  )
  return {"params": params, "m": m, "v": v}
