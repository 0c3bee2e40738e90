"""Sequence parallelism's collectives (parallelism/sequence.py) in the compiled step: each
tensor-parallel region's all-gather and reduce-scatter run over the `tensor` ranks alone,
each replica on its own tokens (issue 32: the batch was gathered over `data` first)."""

import dataclasses
import math
import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from model import gpt
from parallelism.mesh import AXES
from projection import aot_compile, hlo_text, targets
from tests.small_models import SMALL_LLAMA
from train import step as train_step
from train.config import TrainConfig

_CUDA, _WHY = targets.cuda_available()


def _coordinates(sizes: dict[str, int], axis: str) -> np.ndarray:
  """Each partition id's coordinate along mesh `axis`."""
  shape = [sizes[a] for a in AXES]
  return np.unravel_index(np.arange(math.prod(shape)), shape)[AXES.index(axis)]


def _region_collectives(text: str) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
  """(opcode, replica groups) of every all-gather and reduce-scatter that sequence.py's
  shard_maps wrote (forward and backward, their metadata names the shard_map)."""
  comps, _, _, parts = hlo_text.parse_module(text)
  found = []
  for comp in comps.values():
    for ins in comp.instrs:
      op = ins.opcode.removesuffix("-start")
      if op in ("all-gather", "reduce-scatter") and "shard_map" in hlo_text.op_name(ins):
        groups = hlo_text.parse_replica_groups(ins.attrs.get("replica_groups", "{}"), parts)
        found.append((op, groups))
  return found


def _compiled_text(sizes: dict[str, int], fp8: bool, devices: list) -> str:
  model = dataclasses.replace(SMALL_LLAMA, sequence_parallel=True, fp8=fp8, num_layers=2)
  train = TrainConfig(global_batch=2 * sizes["data"], micro_batch=1, steps=1)
  shape = [sizes[a] for a in AXES]
  mesh = Mesh(
    np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=(AxisType.Auto,) * 6
  )
  lowered = train_step.build(model, train, mesh).lower(train.global_batch, model.seq_len)
  options = dict(aot_compile.FAST_BACKEND) if devices[0].platform != "cpu" else None
  return lowered.compile(compiler_options=options).as_text()


def _assert_tensor_only(sizes: dict[str, int], text: str) -> None:
  """No all-gather or reduce-scatter of a shard_map spans data-parallel replicas (those of
  parallelism/context.py gather K/V over `context`; sequence.py's run over `tensor`)."""
  found = _region_collectives(text)
  assert {op for op, _ in found} == {"all-gather", "reduce-scatter"}, found
  data, tensor = _coordinates(sizes, "data"), _coordinates(sizes, "tensor")
  assert any(len({tensor[i] for i in groups[0]}) == sizes["tensor"] for _, groups in found)
  for op, groups in found:
    for group in groups:
      assert len({data[i] for i in group}) == 1, (op, groups)


_LAYOUTS = [
  (dict(data=2, fsdp=1, expert=1, context=1, tensor=2, pipeline=1), False),
  (dict(data=2, fsdp=1, expert=1, context=2, tensor=2, pipeline=1), True),
]
_IDS = ["data2-tensor2", "data2-context2-tensor2-fp8"]


@pytest.mark.parametrize("sizes, fp8", _LAYOUTS, ids=_IDS)
def test_region_collectives_stay_on_the_tensor_ranks_on_host(sizes, fp8):
  devices = jax.devices("cpu")[: math.prod(sizes.values())]
  _assert_tensor_only(sizes, _compiled_text(sizes, fp8, devices))


@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
@pytest.mark.parametrize("sizes, fp8", _LAYOUTS, ids=_IDS)
def test_region_collectives_stay_on_the_tensor_ranks_on_h100(sizes, fp8):
  n = math.prod(sizes.values())
  devices = targets.target_devices("h100", 1, n)
  _assert_tensor_only(sizes, _compiled_text(sizes, fp8, devices))


@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
def test_fp8_regions_gather_fp8_both_ways_on_h100():
  """With FP8 every sequence-parallel all-gather moves FP8: the entries' inputs as E4M3
  forward, the exits' output gradients as E5M2 backward (Transformer Engine's
  grad_output_preprocess casts before it gathers), half the bytes of bfloat16. The exits'
  gradients were gathered in bfloat16 before this."""
  sizes = dict(data=2, fsdp=1, expert=1, context=1, tensor=2, pipeline=1)
  text = _compiled_text(sizes, True, targets.target_devices("h100", 1, 4))
  comps, _, _, _ = hlo_text.parse_module(text)
  gathered = [
    ins.shape.split("[")[0].lstrip("(")
    for comp in comps.values()
    for ins in comp.instrs
    if ins.opcode.removesuffix("-start") == "all-gather" and "shard_map" in hlo_text.op_name(ins)
  ]
  assert "f8e4m3fn" in gathered and "f8e5m2" in gathered, gathered
  assert not [t for t in gathered if t in ("bf16", "f32")], gathered


def _whole_sequence_transposes(text: str, elements: int) -> int:
  """Kernels that transpose (fusions XLA names after their root transpose) and write at
  least `elements` values: passes over a whole sequence of activations."""
  comps, _, _, _ = hlo_text.parse_module(text)
  count = 0
  for comp in comps.values():
    for ins in comp.instrs:
      dims = [int(d) for d in re.findall(r"\d+", ins.shape.split("{")[0].split("]")[0])]
      if ins.opcode == "fusion" and "transpose" in ins.name and math.prod(dims) >= elements:
        count += 1
  return count


@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
def test_sequence_major_regions_drop_whole_sequence_transposes_on_h100(monkeypatch):
  """At more than one sequence a micro-batch the attention output projection and the MLP
  run sequence-major (model/gpt.py `_sequence_major`), so their collectives along the
  sequence split and join the leading axis: XLA no longer transposes whole sequences of
  the exits' products and the MLP's gathered input around them."""
  sizes = dict(data=2, fsdp=1, expert=1, context=1, tensor=2, pipeline=1)
  model = dataclasses.replace(SMALL_LLAMA, sequence_parallel=True, fp8=True, num_layers=2)
  train = TrainConfig(global_batch=8, micro_batch=2, steps=1)
  mesh = Mesh(
    np.asarray(targets.target_devices("h100", 1, 4), dtype=object).reshape(
      [sizes[a] for a in AXES]
    ),
    AXES,
    axis_types=(AxisType.Auto,) * 6,
  )

  def transposes() -> int:
    lowered = train_step.build(model, train, mesh).lower(train.global_batch, model.seq_len)
    text = lowered.compile(compiler_options=dict(aot_compile.FAST_BACKEND)).as_text()
    # A micro-batch's tokens on one replica, every feature: 2 x 16 x 32.
    return _whole_sequence_transposes(text, train.micro_batch * model.seq_len * model.d_model)

  sequence_major = transposes()
  monkeypatch.setattr(gpt, "_sequence_major", lambda cfg, batch: (lambda a: a,) * 3)
  batch_major = transposes()
  assert sequence_major < batch_major, (sequence_major, batch_major)
