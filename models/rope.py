"""Rotary position embeddings (Su et al., 2021), with Llama-3 or linear frequency scaling."""

import math

import jax.numpy as jnp


def rope_frequencies(head_dim: int, theta: float, scaling=None):
  """Inverse frequencies [head_dim // 2]; `scaling` (a config.RopeScaling) stretches the low
  frequencies (llama3, Llama 3.1) or all of them (linear)."""
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if scaling is None:
    return inv_freq
  if scaling.rope_type == "linear":
    return inv_freq / scaling.factor
  low_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  # Between the two wavelengths, interpolate smoothly between scaled and unscaled.
  smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  return jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor,
                   jnp.where(wavelen < high_wavelen, inv_freq, blended))


def apply_rope(x, positions, inv_freq):
  """x: [B, L, H, D]; positions: [B, L]. Rotates the two halves of D (the HF layout)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, L, D/2]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
