"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

import optax


def learning_rate_schedule(train_cfg):
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train_cfg.learning_rate,
      warmup_steps=min(train_cfg.warmup_steps, max(train_cfg.steps - 1, 0)),
      decay_steps=max(train_cfg.steps, 1),
      end_value=train_cfg.learning_rate * train_cfg.min_lr_ratio)


def make_optimizer(train_cfg, decay_mask) -> optax.GradientTransformation:
  """decay_mask: a params-shaped tree of bools, from each parameter's declared
  `weight_decay` (Runtime.decay_mask): norm scales say False."""
  adamw = optax.adamw(learning_rate_schedule(train_cfg), b1=train_cfg.b1, b2=train_cfg.b2,
                      eps=train_cfg.eps, weight_decay=train_cfg.weight_decay, mask=decay_mask)
  if train_cfg.grad_clip is None:
    return adamw
  return optax.chain(optax.clip_by_global_norm(train_cfg.grad_clip), adamw)
