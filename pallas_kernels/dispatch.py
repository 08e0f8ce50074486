"""The one entry point models call for attention; picks an implementation."""

from jaxpar.pallas_kernels.reference import attention_reference

IMPLEMENTATIONS = ("auto", "reference")


def attention(q, k, v, *, causal=True, segment_ids=None, sliding_window=None,
              logit_soft_cap=None, scale=None, implementation="auto"):
  """q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D] -> [B, Lq, Hq, D]."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
  return attention_reference(q, k, v, causal=causal, segment_ids=segment_ids,
                             sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                             scale=scale)
