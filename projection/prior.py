"""The search's analytic prior (projection/search.py): a back-of-envelope step time and
memory per GPU for a candidate configuration, used only to order candidates before they
are projected. Every reported number is a projection; this module's figures are not."""

import dataclasses

import jax
import numpy as np

from hardware.catalog import Hardware
from model import moe
from model.flops import (
  lora_adapter_param_count,
  lora_train_flops_per_token,
  param_count,
  routed_expert_param_count,
)
from parallelism import one_f_one_b, pipeline
from parallelism.mesh import AXES
from projection import collectives, layout

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Prior:
  """A back-of-envelope estimate, used only to order candidates.

  Memory: parameters and optimizer state per GPU, exact from their shardings; the
  gradients, one copy of the parameters; saved activations, per layer and token as the
  remat policy saves them (`activation_bytes_per_token_layer`). A pipelined step keeps
  every micro-batch's activations of its stage in a pass (the lockstep schedule runs a
  pass's forward trips before its backward ones); the 1f1b schedule, its forward chunks
  in flight (about P micro-batches' worth); gradient accumulation keeps one
  micro-batch's.

  Time: model FLOPs (x 4/3 under full remat) at the achievable matmul rate, stretched by
  the pipeline's idle trips; each micro-batch reading its GPU's weights from HBM (3
  passes, 4 with full remat); tensor-parallel activations (8 x d_model bytes per token
  and layer, each way) over NVLink; context parallelism's K/V gathers (2 x K/V heads x
  head size bytes a token and layer, each pass) and the gradient all-reduce over data and
  context, over the NICs. Context ranks split the tokens, and so the activations. With
  LoRA (`exp.lora`): the state is the frozen weights, adapters and their moments; the
  FLOPs are LoRA's, the weights read as stored, and the gradients the adapters' alone.

  A mixture of experts: expert ranks split the batch like data ranks; the routed
  experts' weights (and so their reads and gradients) split over expert, their gradients
  reduced over data alone, the rest over data x expert; and each routed layer's
  all-to-alls (`expert_all_to_all_s`, `expert_s`) priced by projection/collectives.py
  on the NVLink domains the expert groups span, so that a group inside one domain costs
  less than one across domains. The capacity buffers' activations are not counted.
  """

  state_gb: float
  gradients_gb: float
  activations_gb: float
  step_s: float
  bubble_fraction: float
  expert_s: float = 0.0  # of step_s: the expert all-to-alls (`expert_all_to_all_s`)

  @property
  def memory_gb(self) -> float:
    return self.state_gb + self.gradients_gb + self.activations_gb


def activation_bytes_per_token_layer(model, tp: int) -> float:
  """Bytes a GPU keeps per token and layer for the backward pass under model.remat, the
  policies' saved values (model/gpt.py _REMAT) in bfloat16: "full" the layer input;
  "save_dots" every weight matmul's output, the column-parallel ones (Q/K/V, fc1 or
  gate/up) split over tensor, the row-parallel ones (attention output, fc2 or down) whole,
  as they leave the matmul before their reduce-scatter; "elementwise" the layer input and
  the mid-block residual, Q/K/V, the attention output and fc1 (gate/up). "none":
  34 x d_model bytes (Korthikanti et al. 2022, flash attention). The residual stream's
  values are split over tensor with sequence parallelism."""
  d = model.d_model
  shard = tp if model.sequence_parallel else 1
  qkv = (model.num_heads + 2 * model.kv_heads) * model.head_dim
  attention = model.num_heads * model.head_dim
  mlp_in = (2 if model.mlp == "swiglu" else 1) * model.d_ff
  values = {
    "full": d / shard,
    "save_dots": (qkv + mlp_in) / tp + 2 * d,
    "elementwise": 2 * d / shard + (qkv + attention + mlp_in) / tp,
    "none": 17 * d / shard,
  }[model.remat]
  return 2 * values


def prior(exp, hw: Hardware, reduced: layout.ReducedMesh, state_bytes: int) -> Prior:
  """`Prior` of `exp` laid out as `reduced.target` on `hw`."""
  model, sizes = exp.model, reduced.target.sizes
  tp, pp, data, fsdp = sizes["tensor"], sizes["pipeline"], sizes["data"], sizes["fsdp"]
  cp, ep = sizes.get("context", 1), sizes.get("expert", 1)
  virtual = exp.train.virtual_stages if pp > 1 else 1
  micro = reduced.micro_batches
  # Expert-parallel ranks are data-parallel outside the experts: the batch splits over them.
  per_replica_tokens = exp.train.global_batch // (data * fsdp * ep) * model.seq_len
  layers_per_gpu = model.num_layers / pp
  d = model.d_model
  per_token_layer = activation_bytes_per_token_layer(model, tp)
  schedule = exp.train.pipeline_schedule
  passes = pipeline.passes(exp.train.pipeline_passes, micro, pp, schedule) if pp > 1 else 1
  held_tokens = per_replica_tokens / passes if pp > 1 else per_replica_tokens / micro
  held_layers = layers_per_gpu
  if pp > 1 and schedule == "1f1b":
    # The forward chunks in flight: slots of a chunk's layers on one micro-batch.
    held_tokens = per_replica_tokens / micro
    held_layers = one_f_one_b.schedule(micro, pp, virtual).slots * layers_per_gpu / virtual
  # Each context rank holds 1 / CP of every sequence's tokens.
  activations = held_tokens * held_layers * per_token_layer / cp
  # LoRA (exp.lora): the frozen weights are read as stored; only the adapters' gradients
  # are reduced.
  adapters = getattr(exp, "lora", None)
  lora = adapters is not None and adapters.enabled
  dtype = adapters.base_dtype if lora else model.param_dtype
  # The routed experts' weights are split over expert too (0 for a dense model).
  experts = routed_expert_param_count(model)
  itemsize = jax.numpy.dtype(dtype).itemsize
  weight_bytes = (param_count(model) - experts + experts / ep) * itemsize / (tp * pp * fsdp)
  expert_grad_bytes = experts / ep * itemsize / (tp * pp * fsdp)
  grad_bytes = weight_bytes
  if lora:
    grad_bytes = lora_adapter_param_count(model, adapters) * 2 / (tp * pp * fsdp)

  gpus = reduced.target.devices
  flops = lora_train_flops_per_token(model, adapters) * exp.train.global_batch * model.seq_len
  flops /= gpus
  flops *= 4 / 3 if model.remat == "full" else 1
  rate = (hw.achievable_tflops("fp8") if model.fp8 else None) or hw.achievable_tflops("bf16")
  bubble = pipeline.bubble_fraction(micro // passes, pp, virtual) if pp > 1 else 0.0
  compute_s = flops / (rate * 1e12) / (1 - bubble)
  weight_reads = 4 if model.remat == "full" else 3
  hbm_s = micro * weight_reads * weight_bytes / (hw.hbm_achievable_tb_s * 1e12)
  tp_bytes = 2 * 8 * d * per_replica_tokens / cp * layers_per_gpu * (tp - 1) / tp
  tp_s = tp_bytes / (hw.allgather_ring_busbw_gb_s * 1e9) if tp > 1 else 0.0
  # Context: each layer gathers the other ranks' K/V (2 G K bf16 values a token) forward,
  # again when full remat recomputes it, and reduce-scatters dK/dV backward; over NVLink
  # when tensor x context fits in the NVLink domain, else over the NICs.
  kv_bytes = 2 * model.kv_heads * model.head_dim * 2 * per_replica_tokens * (cp - 1) / cp
  cp_bw = hw.allgather_ring_busbw_gb_s if tp * cp <= hw.nvlink_domain_size else hw.nic_gb_s_per_gpu
  cp_passes = 3 if model.remat == "full" else 2
  cp_s = cp_passes * kv_bytes * layers_per_gpu / (cp_bw * 1e9)
  # The gradients are reduced over data and context together, those outside the routed
  # experts over expert as well.
  reducers = data * cp
  shared_reducers = reducers * ep
  dp_s = 2 * (grad_bytes - expert_grad_bytes) * (shared_reducers - 1) / shared_reducers
  dp_s /= hw.nic_gb_s_per_gpu * 1e9
  dp_s += 2 * expert_grad_bytes * (reducers - 1) / reducers / (hw.nic_gb_s_per_gpu * 1e9)
  expert_s = expert_all_to_all_s(exp, hw, reduced, per_replica_tokens / micro) * micro
  step_s = compute_s + hbm_s + tp_s + cp_s + dp_s + expert_s
  return Prior(state_bytes / GB, grad_bytes / GB, activations / GB, step_s, bubble, expert_s)


def expert_all_to_all_s(exp, hw: Hardware, reduced: layout.ReducedMesh, tokens: float) -> float:
  """Seconds of one micro-batch's expert all-to-alls on a GPU, `tokens` its expert rank's
  tokens (0 without expert parallelism). Each routed layer of the GPU's stage sends its
  capacity buffer ([tokens, E x C / T, d_model] in the compute dtype, model/moe.py) to the
  experts and back, forward and backward, and again when full remat recomputes the layer;
  each all-to-all is priced by projection/collectives.py on the NVLink domains the
  target's expert groups span (projection/layout.py; the slowest placement). With
  model.experts_over_tensor a tensor rank's buffer holds its share of the experts."""
  model, sizes = exp.model, reduced.target.sizes
  ep = sizes.get("expert", 1)
  if ep == 1 or not model.moe:
    return 0.0
  shares = sizes.get("tensor", 1) if model.experts_over_tensor else 1
  rows = moe.capacity(model, model.seq_len) * model.num_experts / model.seq_len / shares
  item = jax.numpy.dtype(model.compute_dtype).itemsize
  buffer = int(tokens * rows * model.d_model * item)
  seconds = max(
    collectives.collective_time_s("all-to-all", buffer, domains, hw)
    for domains in _expert_group_domains(reduced)
  )
  calls = 2 * (3 if model.remat == "full" else 2) * model.moe_layers / sizes["pipeline"]
  return calls * seconds


def _expert_group_domains(reduced: layout.ReducedMesh) -> list[tuple[int, ...]]:
  """The NVLink domains of the target's expert groups' members, one tuple per distinct
  placement: every group along `expert` of the compiled mesh, placed on the target."""
  shape = [reduced.sizes[a] for a in AXES]
  ids = np.arange(np.prod(shape)).reshape(shape)
  groups = np.moveaxis(ids, AXES.index("expert"), -1).reshape(-1, shape[AXES.index("expert")])
  return layout.target_group_domains(tuple(map(tuple, groups.tolist())), reduced)
