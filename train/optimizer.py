"""AdamW with linear warm-up, cosine decay and global-norm clipping (the GPT-3 recipe)."""

import jax
import optax

from train.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  decay_steps = cfg.lr_decay_steps or cfg.steps
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=cfg.lr_warmup_steps,
    decay_steps=max(decay_steps, cfg.lr_warmup_steps + 1),
    end_value=cfg.learning_rate * cfg.min_lr_ratio,
  )


def _decay_mask(params):
  # Weight decay on matrices only: biases, LayerNorm and (stacked) vectors are exempt.
  # A stacked layer parameter has a leading `layers` (or pipelined `stage`) axis, hence
  # the axes check.
  def is_matrix(x):
    axes = x.get_metadata().get("axes", ())
    return len([a for a in axes if a not in ("layers", "stage")]) >= 2

  return jax.tree.map(is_matrix, params, is_leaf=lambda x: hasattr(x, "get_metadata"))


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  return optax.chain(
    optax.clip_by_global_norm(cfg.grad_clip),
    optax.adamw(
      learning_rate_schedule(cfg),
      b1=cfg.beta1,
      b2=cfg.beta2,
      eps=cfg.eps,
      weight_decay=cfg.weight_decay,
      mask=_decay_mask,
    ),
  )
