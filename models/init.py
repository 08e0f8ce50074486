"""Parameter initialisers shared by the layers."""

from flax import nnx


def fan_in(in_axis=0, out_axis=-1):
  """Truncated normal with variance 1/fan_in over `in_axis` (may be a tuple of axes)."""
  return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                           in_axis=in_axis, out_axis=out_axis)


def embedding_init(embed_dim: int):
  # std 1/sqrt(d): with tied embeddings the initial logits then have unit scale.
  return nnx.initializers.normal(stddev=embed_dim ** -0.5)
