"""LoRA: low-rank adapters trained on a frozen decoder (Hu et al. 2021, arXiv:2106.09685).

A target kernel W [in..., out...] of the block (the names model/gpt.py `kernels` gives:
qkv_kernel, or q_kernel and kv_kernel with grouped-query attention, out_kernel, fc1_kernel,
fc2_kernel) gets two trainable matrices, A [in..., r] (Gaussian, std 1/sqrt(in)) and
B [r, out...] (zeros, so the adapted model starts as the base one), and its matmul becomes

    y = x W + (alpha / r) * (dropout(x) A) B

Only A and B (`Adapter` variables) are differentiated and only they have optimizer state
(train/step.py splits the state by this type); the base weights are constants of the step,
so the backward pass runs their input gradients and no weight gradient
(model/flops.py `lora_flops_per_token`).

Stacked like every layer parameter ([L, ...], `layers` axis first), with logical axes that
follow the kernel's: A's input axes are the kernel's input axes, B's output axes the
kernel's output axes, and the rank (`lora_rank`) is replicated (parallelism/rules.py).
Under tensor parallelism A of a column-parallel kernel (QKV, fc1) is replicated and B split
over heads / MLP width; A of a row-parallel one (attention out, fc2) is split over heads /
width like its input, so x A is a partial sum reduced over the tensor ranks ([tokens, r],
r values a token), and B is replicated.

Frozen base weights can be stored as float8_e4m3fn with one scale per layer (`base_dtype`),
as NVIDIA's MLPerf LoRA configurations keep FP8 parameters (NeMo `fp8_params`,
github.com/mlcommons/training_results_v4.1 NVIDIA llama2_70b_lora configs); the FP8
matmuls (model.fp8) then read the stored values as their casts, with no cast a step.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from errors import UserInputError
from model import fp8
from parallelism.rules import constrain

BASE_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
# The logical axis of the adapters' rank dimension (replicated, parallelism/rules.py).
RANK_AXIS = "lora_rank"
_FP8_SCALE = "_fp8_scale"  # suffix of a stored FP8 kernel's per-layer scale [L]
_A, _B = "_lora_a", "_lora_b"  # suffixes of a kernel's adapters


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adaptation of the block's kernels; rank 0: off (every weight trains)."""

  rank: int = 0
  # The adapter's product is scaled by alpha / rank (the LoRA paper's scaling).
  alpha: float = 32.0
  # Dropout on the adapter's input (its own mask; the base matmul sees x unchanged).
  dropout: float = 0.0
  # Comma-separated kernel names (model/gpt.py `kernels`).
  targets: str = "qkv_kernel,out_kernel"
  # Storage of the frozen block kernels: float32, bfloat16, or float8_e4m3fn (with
  # model.fp8, whose matmuls read them as their casts).
  base_dtype: str = "bfloat16"

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def target_names(self) -> tuple[str, ...]:
    return tuple(t.strip() for t in self.targets.split(",") if t.strip())

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def validate(self, model_kernels: tuple[str, ...], known: tuple[str, ...], fp8: bool) -> None:
    """Bad settings raise UserInputError naming the field. model_kernels: the model's
    kernels (gpt.kernels(cfg)); known: every kernel name any model has."""
    if self.rank < 0:
      raise UserInputError(f"lora.rank must be 0 (off) or a positive integer, got {self.rank}")
    if not self.enabled:
      return
    if not (math.isfinite(self.alpha) and self.alpha > 0):
      raise UserInputError(f"lora.alpha must be a positive finite number, got {self.alpha}")
    if not 0 <= self.dropout < 1:
      raise UserInputError(f"lora.dropout must be in [0, 1), got {self.dropout}")
    if self.base_dtype not in BASE_DTYPES:
      raise UserInputError(
        f"lora.base_dtype must be one of {', '.join(BASE_DTYPES)}, got {self.base_dtype!r}"
      )
    if self.base_dtype == "float8_e4m3fn" and not fp8:
      raise UserInputError(
        "lora.base_dtype=float8_e4m3fn needs model.fp8=true (its FP8 matmuls read the "
        "stored weights as their casts)"
      )
    names = self.target_names
    if not names:
      raise UserInputError(f"lora.targets must name kernels among {', '.join(known)}, got ''")
    fused = _FUSED_QKV in names and _FUSED_QKV not in model_kernels
    for name in names:
      if name not in known:
        raise UserInputError(f"lora.targets: unknown kernel {name!r}; allowed: {', '.join(known)}")
      if fused and name in _SPLIT_QKV:
        raise UserInputError(
          f"lora.targets: {_FUSED_QKV} (one adapter on q and kv together) and {name} both "
          "name the query projection; choose one"
        )
      if name not in model_kernels and not (name == _FUSED_QKV and fused):
        raise UserInputError(
          f"lora.targets: this model has no {name} (its kernels: {', '.join(model_kernels)})"
        )
    if len(set(names)) != len(names):
      raise UserInputError(f"lora.targets names a kernel twice: {self.targets!r}")


# With grouped-query attention (separate q_kernel and kv_kernel) the target qkv_kernel is
# one adapter on both, as on Megatron-Core's fused linear_qkv that NVIDIA's MLPerf LoRA
# runs adapt: one A [D, r], a B for the queries and one for the keys and values.
_FUSED_QKV, _SPLIT_QKV = "qkv_kernel", ("q_kernel", "kv_kernel")


def groups(targets: tuple[str, ...], model_kernels) -> list[tuple[str, tuple[str, ...]]]:
  """(A's name, the kernels that share it) for each target on a model with these kernels."""
  return [
    (name, _SPLIT_QKV if name == _FUSED_QKV and name not in model_kernels else (name,))
    for name in targets
  ]


class Adapter(nnx.Param):
  """A LoRA matrix: the only trainable state of a LoRA run."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeight:
  """A target kernel in the layer stack as the block reads it: the frozen base (an array, or
  fp8.CastWeight), its adapters a [.., in..., r] and b [.., r, out...], and the dropout keys
  ([L] typed keys, or None); scale and dropout rate are static."""

  base: object
  a: jax.Array
  b: jax.Array
  key: jax.Array | None
  scale: float = dataclasses.field(metadata=dict(static=True))
  dropout: float = dataclasses.field(metadata=dict(static=True))


def add_adapters(
  layers: nnx.Module, cfg: "LoraConfig", contracted: dict[str, int], rngs: nnx.Rngs, dtype
) -> None:
  """Adapters on `layers` (model/gpt.py Layers, stacked [L, ...]) for cfg's targets, and the
  frozen kernels in cfg.base_dtype. contracted: each kernel's count of input axes."""
  for name in contracted:
    kernel = getattr(layers, name)
    if cfg.base_dtype == "float8_e4m3fn":
      cast = fp8.cast_weights(kernel[...])
      setattr(layers, name, nnx.Param(cast.cast, **kernel.get_metadata()))
      stack_axis = kernel.get_metadata()["axes"][0]
      setattr(layers, name + _FP8_SCALE, nnx.Param(cast.scale, axes=(stack_axis,)))
    else:
      setattr(layers, name, nnx.Param(kernel[...].astype(cfg.base_dtype), **kernel.get_metadata()))
  for a_name, shared in groups(cfg.target_names, contracted):
    for i, name in enumerate(shared):
      n_in = contracted[name]
      kernel = getattr(layers, name)
      shape, axes = kernel.shape, kernel.get_metadata()["axes"]
      stack, ins, outs = shape[:1], shape[1 : 1 + n_in], shape[1 + n_in :]
      if i == 0:
        a_axes = (axes[0], *axes[1 : 1 + n_in], RANK_AXIS)
        std = 1 / math.sqrt(math.prod(ins))
        a = std * jax.random.normal(rngs.params(), (*stack, *ins, cfg.rank), dtype)
        setattr(layers, a_name + _A, Adapter(a, axes=a_axes))
      b_axes = (axes[0], RANK_AXIS, *axes[1 + n_in :])
      b = jnp.zeros((*stack, cfg.rank, *outs), dtype)
      setattr(layers, name + _B, Adapter(b, axes=b_axes))


def adapted(
  layers: nnx.Module, params: dict, scales: dict, cfg: "LoraConfig", key: jax.Array | None
) -> dict:
  """The layer stack's parameters (model/gpt.py GPT.layer_params, in the compute dtype) with
  each target kernel a LoraWeight and each FP8-stored kernel's cast its stored value."""
  params = dict(params)
  for name in [n for n in params if n.endswith(_FP8_SCALE)]:
    kernel = name[: -len(_FP8_SCALE)]
    params.pop(name)  # in the compute dtype: the stored float32 scale instead
    scale = getattr(layers, name)[...]
    stored = getattr(layers, kernel)[...]
    w = params[kernel]
    # The stored values are the cast (gpt.layer_params made one of them again: unused).
    x_scale, g_scale = scales.get(kernel, (None, None))
    axes = getattr(layers, kernel).get_metadata()["axes"]
    weight = w.weight if isinstance(w, fp8.CastWeight) else w
    params[kernel] = fp8.CastWeight(weight, constrain(stored, axes), scale, x_scale, g_scale)
  for i, (a_name, shared) in enumerate(groups(cfg.target_names, params)):
    a = params.pop(a_name + _A)
    keys = None
    if cfg.dropout and key is not None:
      # Kernels that share A share its input and so its dropout mask (one product x A).
      keys = jax.random.split(jax.random.fold_in(key, i), a.shape[0])
    for name in shared:
      params[name] = LoraWeight(
        params[name], a, params.pop(name + _B), keys, cfg.scale, cfg.dropout
      )
  return params


def _rank_letter(spec: str) -> str:
  return next(c for c in "rRzZyY" if c not in spec)


def delta(spec: str, x: jax.Array, w: LoraWeight, x_axes=None) -> jax.Array:
  """The adapter's term of the matmul spec (x [tokens..., in...] -> [tokens..., out...]):
  scale * (dropout(x) A) B, through r values a token. x_axes: x's logical axes, which the
  dropout mask is drawn in (left free, the partitioner draws it whole and gathers x to it:
  70 GB a step over `data` for Llama 2 70B at 512 GPUs)."""
  inputs, out = spec.split("->")
  xs, ws = inputs.split(",")
  tokens = "".join(c for c in xs if c not in ws)
  contracted, features = xs[len(tokens) :], out[len(tokens) :]
  r = _rank_letter(spec)
  if w.key is not None:
    keep = jax.random.bernoulli(w.key, 1 - w.dropout, x.shape)
    if x_axes is not None:
      keep = constrain(keep, x_axes)
    x = jnp.where(keep, x / (1 - w.dropout), 0).astype(x.dtype)
    if x_axes is not None:
      x = constrain(x, x_axes)
  low = jnp.einsum(f"{tokens}{contracted},{contracted}{r}->{tokens}{r}", x, w.a.astype(x.dtype))
  y = jnp.einsum(f"{tokens}{r},{r}{features}->{tokens}{features}", low, w.b.astype(x.dtype))
  return (y * w.scale).astype(x.dtype)


def with_adapters(matmul):
  """matmul(spec, x, w) that also takes a LoraWeight: the base's product plus the adapter's."""

  def adapted_matmul(spec: str, x: jax.Array, w) -> jax.Array:
    if isinstance(w, LoraWeight):
      return matmul(spec, x, w.base) + delta(spec, x, w)
    return matmul(spec, x, w)

  return adapted_matmul


def trainable_params(cfg: "LoraConfig", tree):
  """The trainable part of a model's parameter state: the adapters (LoRA), else all."""
  return nnx.filter_state(tree, Adapter) if cfg.enabled else tree
