"""Deviceless compiles for NVIDIA targets (projection/targets.py), parsed by projection/hlo.py.

Skipped where jax-cuda12-plugin cannot build GPU topologies.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from projection import hlo, targets

_OK, _WHY = targets.cuda_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"no deviceless CUDA: {_WHY}")


def _mesh(hardware, nodes=2, gpus_per_node=4):
  devices = targets.target_devices(hardware, nodes, gpus_per_node)
  return Mesh(
    np.array(devices).reshape(nodes, gpus_per_node),
    ("node", "gpu"),
    axis_types=(AxisType.Auto, AxisType.Auto),
  )


def _sharded_matmul(mesh, m=512, k=1024, n=256):
  # k is split over the GPUs of a node, so the product needs an all-reduce inside each node.
  a = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=NamedSharding(mesh, P("node", "gpu")))
  b = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=NamedSharding(mesh, P("gpu", None)))
  out = NamedSharding(mesh, P("node", None))
  return jax.jit(lambda x, y: jnp.tanh(x @ y), out_shardings=out).lower(a, b).compile()


@pytest.mark.parametrize("hardware", targets.HARDWARE)
def test_every_target_compiles_a_sharded_matmul(hardware):
  mesh = _mesh(hardware)
  devices = mesh.devices.ravel()
  assert [d.process_index for d in devices] == [0, 0, 0, 0, 1, 1, 1, 1]
  assert hardware.upper() in devices[0].device_kind.upper()
  compiled = _sharded_matmul(mesh)
  assert compiled.memory_analysis() is not None
  program = hlo.analyze(compiled.as_text())
  assert hlo.dot_flops(program) == 2 * (512 // 2) * 256 * (1024 // 4)
  gemms = [n for n, _ in hlo.walk(program) if isinstance(n, hlo.Compute) and n.dot_flops]
  assert gemms and all(g.dot_dtype == "bf16" for g in gemms)


def test_h100_program_has_async_collectives_and_memory_analysis():
  compiled = _sharded_matmul(_mesh("h100"))
  assert compiled.cost_analysis() is None  # why projection/hlo.py exists
  assert compiled.memory_analysis().argument_size_in_bytes > 0
  program = hlo.analyze(compiled.as_text())
  assert program.num_partitions == 8
  (ar,) = [c for c, _ in hlo.collectives(program)]
  assert ar.kind == "all-reduce" and ar.is_async and ar.done is not None
  assert set(ar.groups) == {(0, 1, 2, 3), (4, 5, 6, 7)}  # within each node
  assert ar.bytes == (512 // 2) * 256 * 2
  assert any(isinstance(n, hlo.AsyncDone) and n.start == ar.name for n in program.entry)


def test_gpu_layer_scan_trip_count_and_collectives_per_layer():
  mesh = _mesh("h100")
  layers, batch, d = 6, 64, 256

  def step(x, ws):
    return jax.lax.scan(lambda c, w: (jax.nn.relu(c @ w), None), x, ws)[0].sum()

  x = jax.ShapeDtypeStruct((batch, d), jnp.bfloat16, sharding=NamedSharding(mesh, P("node")))
  ws = jax.ShapeDtypeStruct(
    (layers, d, d), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "gpu", None))
  )
  program = hlo.analyze(jax.jit(jax.grad(step, argnums=1)).lower(x, ws).compile().as_text())
  loops = [n for n in program.entry if isinstance(n, hlo.Loop)]
  assert loops and all(loop.trip_count == layers for loop in loops)
  assert all(loop.trip_count_source == "backend_config" for loop in loops)
  # Forward, input-gradient and weight-gradient matmul of every layer, split 8 ways.
  assert hlo.dot_flops(program) == layers * 3 * 2 * batch * d * d / 8
  assert any(m == layers for _, m in hlo.collectives(program))


def test_unknown_hardware_is_rejected():
  with pytest.raises(ValueError, match="unknown hardware"):
    targets.target_config("tpu9")


def test_h100_drain_reduce_scatter_runs_beside_the_backward_gemms():
  """train.overlap_grad_reduce (parallelism/one_f_one_b.py): in the deviceless H100 program
  the 1F1B drain's reducing loop reduce-scatters each final chunk's gradients over `data`
  asynchronously, with the trips' backward GEMMs scheduled between its start and done
  (3 chunks a rank: a loop of 2 iterations; XLA inlines a loop of one)."""
  from model.config import ModelConfig
  from projection import aot_compile, step_loops
  from train.config import TrainConfig

  model = ModelConfig(
    num_layers=12, d_model=256, num_heads=4, head_dim=64, seq_len=128, vocab_size=512,
    param_dtype="bfloat16", compute_dtype="bfloat16", remat="elementwise",
  )  # fmt: skip
  train = TrainConfig(
    global_batch=16, micro_batch=1, pipeline_schedule="1f1b", virtual_stages=3,
    shard_optimizer=True,
  )  # fmt: skip
  sizes = (("data", 2), ("fsdp", 1), ("expert", 1), ("context", 1), ("tensor", 1), ("pipeline", 4))
  program = aot_compile.compile_step(model, train, sizes, "h100", 4).program
  (loop,) = step_loops.drain_reduce_loops(program)
  gemms = {n.name for n in loop.body if isinstance(n, hlo.Compute) and n.dot_flops}
  # Tensor 1: every reduce-scatter is over `data`.
  scatters = [c for c, _ in hlo.collectives(loop.body) if c.kind == "reduce-scatter"]
  assert scatters
  assert all(c.is_async and not c.xla_sync for c in scatters)
  assert any(gemms & set(c.overlapped) for c in scatters)
