"""Group advantages and the policy losses of GRPO and its variants, on per-token arrays.

Every prompt is sampled `group_size` times; a completion's advantage is its reward against
its group's:
- GRPO (Shao et al. 2024): (r - mean) / (std + eps);
- Dr. GRPO (Liu et al. 2025): r - mean (no std: hard and easy prompts weigh the same).
A group whose rewards are all equal teaches nothing (advantage 0); DAPO's dynamic sampling
(Yu et al. 2025) drops such groups from the batch.

The per-token surrogate, with ratio = exp(logp - logp_behaviour) and advantage A:
  -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
(+ kl_coef * k3, k3 = exp(ref - logp) - (ref - logp) - 1, Schulman's unbiased KL estimator)
and the variants differ in what they average over:
- grpo: each completion's mean over its tokens, then the mean over completions;
- dr_grpo: the sum over all tokens / (completions x max_tokens): no length bias;
- dapo: the sum over all tokens / their count (token-level), with clip_high > clip_low;
- gspo (Zheng et al. 2025): one ratio per completion, exp(mean over its tokens of
  logp - logp_behaviour), clipped as a whole; the mean over completions.
Everything is returned as sums with a unit count ("tokens"), as the train step divides
them, so microbatches and devices add up to the same loss.
"""

import jax.numpy as jnp
import numpy as np

LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")


def group_advantages(rewards: np.ndarray, group_size: int, *, scale: bool, eps: float = 1e-4):
  """rewards [groups * group_size] (a group's samples together) -> (advantages [same],
  zero-variance mask [same]: the group's rewards are all equal)."""
  grouped = rewards.reshape(-1, group_size)
  centred = grouped - grouped.mean(axis=1, keepdims=True)
  std = grouped.std(axis=1, keepdims=True)
  flat = np.repeat(np.ptp(grouped, axis=1) == 0, group_size)
  advantages = centred / (std + eps) if scale else centred
  return advantages.reshape(-1).astype(np.float32), flat


def policy_loss(logp, behaviour, advantages, mask, *, loss: str, clip_low: float, clip_high: float,
                max_tokens: int, reference=None, kl_coef: float = 0.0):
  """Per-token arrays [rows, length] (advantages: each row's, broadcast along it; mask: 1 on
  the completion tokens that carry loss) -> (summed loss, {name: summed metric}, unit count).

  Metrics (summed like the loss, so / unit count is their mean): kl (k3, when a reference is
  given), clip_fraction (tokens, or completions under gspo, whose ratio was clipped),
  ratio_deviation (|ratio - 1|: 0 exactly when the policy is the behaviour)."""
  mask = mask.astype(jnp.float32)
  lengths = jnp.sum(mask, axis=-1)
  rows = (lengths > 0).astype(jnp.float32)
  per_row = mask / jnp.maximum(lengths, 1.0)[:, None]  # each completion's token mean
  log_ratio = logp - behaviour
  if loss == "gspo":
    seq_ratio = jnp.exp(jnp.sum(log_ratio * per_row, axis=-1))
    adv = jnp.sum(advantages * per_row, axis=-1)
    clipped = jnp.clip(seq_ratio, 1 - clip_low, 1 + clip_high)
    surrogate = -jnp.minimum(seq_ratio * adv, clipped * adv) * rows
    total, unit = jnp.sum(surrogate), jnp.sum(rows)
    metrics = {"clip_fraction": jnp.sum((clipped != seq_ratio) * rows),
               "ratio_deviation": jnp.sum(jnp.abs(seq_ratio - 1) * rows)}
    weights = per_row  # the KL term: each completion's token mean
  else:
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1 - clip_low, 1 + clip_high)
    surrogate = -jnp.minimum(ratio * advantages, clipped * advantages)
    if loss == "dapo":
      weights, unit = mask, jnp.sum(mask)
    elif loss == "dr_grpo":
      weights, unit = mask / max_tokens, jnp.sum(rows)
    else:
      weights, unit = per_row, jnp.sum(rows)
    total = jnp.sum(surrogate * weights)
    metric_weights = mask if loss == "dapo" else per_row
    metrics = {"clip_fraction": jnp.sum((clipped != ratio) * metric_weights),
               "ratio_deviation": jnp.sum(jnp.abs(ratio - 1) * metric_weights)}
  if reference is not None:
    delta = reference - logp
    k3 = jnp.exp(delta) - delta - 1
    weights_kl = mask if loss == "dapo" else per_row
    metrics["kl"] = jnp.sum(k3 * weights_kl)
    if kl_coef:
      total = total + kl_coef * jnp.sum(k3 * (weights if loss != "gspo" else per_row))
  return total, metrics, unit
