"""The sampler's greedy argmax is NumPy's (the first index of the largest) on ties, on
vocabularies that are not a multiple of its block and on rows of -inf; rows with NaN get an
index in range."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.inference.sampling import argmax


@pytest.mark.parametrize("vocab", [32000, 50257, 7])
def test_argmax_is_numpys_first_largest(vocab):
  rng = np.random.default_rng(vocab)
  logits = rng.standard_normal((6, vocab)).astype(np.float32)
  logits[1, [3, vocab - 1]] = 50.0  # a tie: the first wins
  logits[2, -1] = 60.0  # the very last entry, in the padded block
  logits[3] = -np.inf  # nothing finite: index 0, as NumPy
  logits[4] = np.nan
  logits[5, [1, vocab // 2]] = np.nan, 70.0
  got = np.asarray(jax.jit(argmax)(jnp.asarray(logits)))
  np.testing.assert_array_equal(got[:4], np.argmax(logits[:4], axis=-1))
  assert all(0 <= i < vocab for i in got[4:])
