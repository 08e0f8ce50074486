"""Training FLOPs per token of a decoder, counted MaxText's way."""

from jaxpar.models.layer_pattern import layer_mixer, layer_options
from jaxpar.models.registry import get_block


def attention_params(cfg) -> int:
  """Matmul parameters of one layer of the model's attention block, as the block counts them."""
  return get_block("attention", cfg.attention_block).matmul_params(cfg)


def mixer_params(cfg) -> int:
  """Matmul parameters of every layer's token mixer (a hybrid's differ by layer)."""
  return sum(get_block("attention", layer_mixer(cfg, i)).matmul_params(cfg) for i in range(cfg.num_layers))


def causal_attention_flops(cfg, seq_len: int) -> float:
  """Scores and values per token, forward + backward: per layer 2 flops x seq x heads x
  (q/k head dim + v head dim), halved for the causal mask, x 3. A layer with a sliding window w below
  seq_len sees w - w^2 / (2 seq) keys per query on average, not seq / 2. A linear-attention
  layer counts its recurrence instead (its block's `mixing_flops`), the same at any length."""
  total = 0.0
  for i in range(cfg.num_layers + getattr(cfg, "mtp_depth", 0)):  # multi-token prediction's layer too
    block = get_block("attention", layer_mixer(cfg, i))
    if getattr(block, "linear", False):
      total += block.mixing_flops(cfg)
      continue
    w = layer_options(cfg, i).attention.sliding_window
    span = seq_len if w is None or w >= seq_len else 2 * w - w * w / seq_len
    total += 3 * span * cfg.num_heads * sum(block.head_dims(cfg))
  return total


def per_layer_input_params(cfg) -> int:
  """Matmul parameters of per-layer inputs (Gemma 4): the [embed, layers x dim] projection,
  and each layer's gate and up projection (the table is a lookup)."""
  return 3 * cfg.num_layers * cfg.embed_dim * cfg.per_layer_input_dim


def dense_matmul_params(cfg) -> int:
  """Parameters that take part in matmuls: every projection plus the output head."""
  return (mixer_params(cfg) + cfg.num_layers * 3 * cfg.embed_dim * cfg.mlp_dim + cfg.embed_dim * cfg.vocab_size
          + per_layer_input_params(cfg))


def dense_train_flops_per_token(cfg, seq_len: int) -> float:
  """6 x matmul params (forward + backward) plus causal attention."""
  return 6 * dense_matmul_params(cfg) + causal_attention_flops(cfg, seq_len)


def moe_active_matmul_params(cfg) -> int:
  """Matmul parameters one token passes through in a mixture-of-experts decoder: attention,
  the router, its k routed experts and the shared expert (and its gate) in MoE layers, the dense MLP in
  the first `first_dense_layers`, and the output head; with multi-token prediction
  (DeepSeek-V3) its merge projection, one more MoE layer and the head again. Idle experts
  do no work."""
  m, e = cfg.moe, cfg.embed_dim
  moe_ffn = e * (m.num_experts + m.shared_gate) + 3 * e * (m.experts_per_token * m.expert_mlp_dim + m.shared_mlp_dim)
  dense = cfg.first_dense_layers
  mtp = getattr(cfg, "mtp_depth", 0) * (2 * e * e + attention_params(cfg) + moe_ffn + e * cfg.vocab_size)
  return (mixer_params(cfg) + dense * 3 * e * cfg.mlp_dim
          + (cfg.num_layers - dense) * moe_ffn + e * cfg.vocab_size + mtp)


def moe_train_flops_per_token(cfg, seq_len: int) -> float:
  """6 x active matmul params plus causal attention: what MFU counts for MoE models."""
  return 6 * moe_active_matmul_params(cfg) + causal_attention_flops(cfg, seq_len)
