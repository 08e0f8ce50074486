"""Top-k routing of tokens to experts, and the statistics that keep their load balanced."""

import jax
import jax.numpy as jnp


def route(logits, bias, moe):
  """Router logits [..., E] (float32) -> (expert ids int32 [..., k], combine weights
  float32 [..., k], scores [..., E]).

  Scores are a softmax over experts or independent sigmoids (`moe.router`). The experts
  are the top k of scores + bias (the bias only steers the choice: DeepSeek-V3); their
  weights are the unbiased scores, renormalised to sum 1 if `moe.normalize_weights`,
  times `moe.routed_scale`. With `moe.num_groups` > 1 only the experts of each token's
  best `moe.groups_per_token` groups may be chosen (node-limited routing).
  """
  scores = jax.nn.softmax(logits, axis=-1) if moe.router == "softmax" else jax.nn.sigmoid(logits)
  choice = scores if bias is None else scores + bias
  if moe.num_groups > 1:
    choice = _best_groups_only(choice, moe.num_groups, moe.groups_per_token)
  _, ids = jax.lax.top_k(choice, moe.experts_per_token)
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if moe.normalize_weights:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return ids.astype(jnp.int32), weights * moe.routed_scale, scores


def _best_groups_only(choice, num_groups: int, groups_per_token: int):
  """choice [..., E] with the experts outside each token's best groups at -inf; a group's
  worth is the sum of its two best choice scores (DeepSeek-V3)."""
  grouped = choice.reshape(*choice.shape[:-1], num_groups, -1)
  worth = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], axis=-1)
  _, best = jax.lax.top_k(worth, groups_per_token)
  keep = jnp.any(jax.nn.one_hot(best, num_groups) > 0, axis=-2)  # [..., groups]
  return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)


def load_fractions(ids, num_experts: int):
  """Fraction of all token-assignments that picked each expert: [E], sums to 1."""
  counts = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32), axis=tuple(range(ids.ndim)))
  return counts / ids.size


def balance_loss(load, scores, router: str):
  """Switch Transformer's load-balancing loss, E x sum_e load_e x mean score_e: 1 when both
  are uniform, larger when the experts that get more tokens also score higher. Sigmoid
  scores are normalised per token first (DeepSeek-V3's balance loss, over the batch)."""
  if router == "sigmoid":
    scores = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
  mean_score = jnp.mean(scores.reshape(-1, scores.shape[-1]), axis=0)
  return scores.shape[-1] * jnp.sum(jax.lax.stop_gradient(load) * mean_score)


def router_z_loss(logits):
  """ST-MoE's z-loss: mean squared log-partition of the router logits (keeps them small)."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


def updated_bias(bias, load, rate: float):
  """DeepSeek-V3's update: raise the bias of under-loaded experts, lower the over-loaded."""
  return bias + rate * jnp.sign(jnp.mean(load) - load)
