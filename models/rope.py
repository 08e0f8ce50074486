"""Rotary position embeddings (Su et al., 2021), with Llama-3, linear, YaRN or proportional
frequency scaling."""

import math

import jax.numpy as jnp


def rope_frequencies(head_dim: int, theta: float, scaling=None):
  """Inverse frequencies [head_dim // 2]; `scaling` (a config.RopeScaling) stretches the low
  frequencies (llama3, Llama 3.1; yarn) or all of them (linear)."""
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if scaling is None:
    return inv_freq
  if scaling.rope_type == "linear":
    return inv_freq / scaling.factor
  if scaling.rope_type == "yarn":
    return _yarn(inv_freq, head_dim, theta, scaling)
  if scaling.rope_type == "proportional":
    # Zero frequencies past the turning pairs: those pairs rotate by nothing, so the
    # rotation still pairs entry i with i + head_dim / 2, as the whole head_dim's does.
    turning = int(scaling.fraction * head_dim // 2)
    return jnp.where(jnp.arange(head_dim // 2) < turning, inv_freq / scaling.factor, 0.0)
  low_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  # Between the two wavelengths, interpolate smoothly between scaled and unscaled.
  smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  return jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor,
                   jnp.where(wavelen < high_wavelen, inv_freq, blended))


def _yarn(inv_freq, head_dim: int, theta: float, scaling):
  """YaRN (Peng et al., 2023): dimension i keeps its frequency when it turns more than
  beta_fast times over the original context, is divided by `factor` below beta_slow turns,
  and blends linearly between."""
  def dimension(turns):  # the dimension whose frequency turns `turns` times over the context
    return head_dim * math.log(scaling.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))
  low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
  if scaling.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  span = high - low if high != low else 1e-3  # as transformers keeps a one-point ramp finite
  ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / span, 0, 1)
  return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def attention_factor(scaling) -> float:
  """What YaRN multiplies the rotated q and k by (1.0 for every other scaling)."""
  if scaling is None or scaling.rope_type != "yarn":
    return 1.0
  if scaling.attention_factor is not None:
    return scaling.attention_factor
  return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def softmax_mscale(scaling) -> float:
  """What multi-head latent attention multiplies its softmax scale by under YaRN (DeepSeek-V3's
  mscale_all_dim; 1.0 otherwise)."""
  if scaling is None or scaling.rope_type != "yarn" or not scaling.mscale_all_dim or scaling.factor <= 1:
    return 1.0
  return (0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0) ** 2


def apply_rope(x, positions, inv_freq, factor: float = 1.0):
  """x: [B, L, H, D]; positions: [B, L]. Rotates the two halves of the first 2 * len(inv_freq)
  entries of D (the HF layout; fewer than D: partial rotary, the rest pass unchanged);
  `factor` scales the rotated part (YaRN's attention factor)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, L, R/2]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  if factor != 1.0:
    sin, cos = sin * factor, cos * factor
  rotary = 2 * inv_freq.shape[-1]
  x1, x2 = jnp.split(x[..., :rotary].astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  return rotated if rotary == x.shape[-1] else jnp.concatenate([rotated, x[..., rotary:]], axis=-1)
