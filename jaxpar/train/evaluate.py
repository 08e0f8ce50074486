"""Held-out perplexity: exp(mean next-token cross-entropy) over fixed windows of text.

Windows are consecutive, non-overlapping, unpacked: every token of a window is predicted
from the window's earlier tokens only, so numbers from different models (float, quantized
weights, a quantized KV cache) compare exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import DataError
from jaxpar.train.loss import causal_lm_loss


def split_heldout(documents: list[str], count: int) -> tuple[list[str], str]:
  """(training documents, held-out text): the last `count` documents are held out, so a
  model trained on the rest never saw them."""
  if not 0 < count < len(documents):
    raise DataError(f"cannot hold out {count} of {len(documents)} documents")
  return documents[:-count], "\n\n".join(documents[-count:])


def token_windows(text: str, tokenizer, seq_len: int, count: int | None = None) -> np.ndarray:
  """The first `count` (default: all) windows of seq_len + 1 tokens of `text`:
  [count, seq_len + 1] (inputs are [:, :-1], targets [:, 1:])."""
  tokens = np.asarray(tokenizer.encode(text), np.int32)
  available = (len(tokens) - 1) // seq_len
  count = available if count is None else count
  if count < 1 or count > available:
    raise DataError(f"the text has {len(tokens)} tokens: room for {available} windows of "
                     f"seq_len={seq_len}, not {count}")
  return np.stack([tokens[i * seq_len:(i + 1) * seq_len + 1] for i in range(count)])


def logits(model, tokens, kv_quantization=None):
  """The model's logits [B, L, vocab] for tokens [B, L]; kv_quantization (a
  kv_quant.KVQuantization): attending as through that quantized KV cache."""
  hidden, _ = model.hidden_states(tokens, kv_quantization=kv_quantization)
  return model.logits(hidden)


def mean_loss(runtime, params, windows, *, batch_size: int = 8, kv_quantization=None) -> float:
  """Mean next-token cross-entropy (nats) of the model over `windows`; kv_quantization (a
  kv_quant.KVQuantization) attends as through that quantized KV cache."""
  @jax.jit
  def batch_loss(params, batch):
    out = logits(runtime.merge(params), batch[:, :-1], kv_quantization)
    return causal_lm_loss(out, batch[:, 1:], jnp.ones(batch[:, 1:].shape))[0]

  total = 0.0
  with runtime.context():
    for start in range(0, len(windows), batch_size):
      total += float(batch_loss(params, jnp.asarray(windows[start:start + batch_size])))
  return total / (windows.shape[0] * (windows.shape[1] - 1))


def perplexity(runtime, params, windows, **options) -> float:
  return float(np.exp(mean_loss(runtime, params, windows, **options)))
