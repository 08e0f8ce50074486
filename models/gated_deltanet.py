"""Gated DeltaNet (Yang, Kautz & Hatamizadeh, 2024), the linear-attention layer of Qwen3-Next
and Qwen3.5: the `gated_deltanet` attention block.

Per value head, a [key_dim, value_dim] state S replaces the keys and values of softmax
attention: S <- exp(g) S, then S <- S + k (beta (v - S^T k))^T (the delta rule writes the
correction of what S already predicts for k), and the output reads S^T q. Before that,
q, k and v each pass a short causal depthwise convolution and SiLU; q and k are
L2-normalised (q also scaled by key_dim^-0.5); beta = sigmoid(b x) and
g = -exp(a_log) softplus(a x + dt_bias). The output is RMS-normalised per head, gated by
SiLU(z x) and projected back. Kimi Delta Attention (`variant: kimi`, Kimi Linear) differs
in its gates only: g = -exp(a_log) softplus(f_b f_a x + dt_bias) has one decay per key
channel (low rank: f_a to head_dim, f_b back to every head's channels), and the output gate
is sigmoid(g_b g_a x), low rank too. The recurrence itself is `pallas_kernels.gated_delta_rule`
(chunked for training and prefill, a reference beside it). Under context parallelism each
device keeps its pieces of the sequence (zig-zag order or not) and only fixed-size states and
convolution tails cross devices (LASP-2; `_split_sequence`).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from jaxpar import pallas_kernels
from jaxpar.errors import ConfigError
from jaxpar.mesh import constrain, mesh_axes, num_shards
from jaxpar.models import caches
from jaxpar.models.dense import dense, projection
from jaxpar.models.init import fan_in
from jaxpar.models.norm import RMSNorm
from jaxpar.models.recurrent_state import RecurrentState, init_states
from jaxpar.models.registry import register_block
from jaxpar.pallas_kernels.linear_attention.sequence_parallel import from_predecessor, gated_delta_rule_split

_L2_EPS = 1e-6  # as the FLA kernels and transformers normalise q and k


def l2_normalize(x):
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + _L2_EPS)


def causal_conv(x, kernel, segment_ids=None, history=None, history_segments=None):
  """Depthwise causal convolution over the length: x [B, L, H, D], kernel [K, H, D]; output
  t is sum_i kernel[i] x[t - (K - 1) + i] (transformers' conv1d layout). `history`
  [B, K-1, H, D]: the inputs before x (None: zeros, the row's start); with `segment_ids`,
  an input of another packed segment than the output's reads as zero (`history_segments`
  [B, K-1]: the history's ids)."""
  taps, length = kernel.shape[0], x.shape[1]
  if history is None:
    history = jnp.zeros((x.shape[0], taps - 1, *x.shape[2:]), x.dtype)
  joined = jnp.concatenate([history.astype(jnp.float32), x.astype(jnp.float32)], axis=1)
  if segment_ids is not None:
    before = jnp.full((x.shape[0], taps - 1), -1, segment_ids.dtype) if history_segments is None else history_segments
    joined_ids = jnp.concatenate([before, segment_ids], axis=1)
  out = jnp.zeros(x.shape, jnp.float32)
  for i in range(taps):
    past = joined[:, i:i + length]
    if segment_ids is not None and i < taps - 1:
      past = jnp.where((joined_ids[:, i:i + length] == segment_ids)[:, :, None, None], past, 0.0)
    out = out + past * kernel[i].astype(jnp.float32)
  return out


def conv_step(x, kernel, history, count, every_token=False):
  """The same convolution continuing a sequence: x [B, T, H, D] after `history` [B, H, K-1, D]
  (the generation cache's layout) -> (output [B, T, H, D], the new history: the last K-1
  inputs of history and each row's first `count` [B] tokens; later ones are padding). With
  `every_token`, the history after each token instead [B, H, T, K-1, D]."""
  taps = kernel.shape[0]
  before = jnp.swapaxes(history, 1, 2)
  joined = jnp.concatenate([before.astype(jnp.float32), x.astype(jnp.float32)], axis=1)
  if every_token:
    after = jnp.stack([joined[:, t + 1:t + taps] for t in range(x.shape[1])], axis=2)  # [B, K-1, T, H, D]
    return causal_conv(x, kernel, history=before), jnp.transpose(after, (0, 3, 2, 1, 4))
  last = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, taps - 1, axis=0))(joined, count)
  return causal_conv(x, kernel, history=before), jnp.swapaxes(last, 1, 2)


class GatedDeltaNet(nnx.Module):
  """Gated DeltaNet over [B, L, embed] -> [B, L, embed] (model.gated_deltanet sets its shape).

  Parameters: q, k [embed, key_heads, key_dim]; v, z [embed, value_heads, value_dim];
  b, a [embed, value_heads]; conv_q, conv_k [kernel, key_heads, key_dim] and conv_v
  [kernel, value_heads, value_dim]; a_log, dt_bias [value_heads]; norm [value_dim]; o
  [value_heads, value_dim, embed]. Value heads are tensor-parallel (`heads`), key heads as
  GQA's kv heads (`kv_heads`).
  """
  linear = True  # no keys or values to attend over: a fixed-size state (flops.py, caches)

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
    g, e = cfg.gated_deltanet, cfg.embed_dim
    hk, hv, dk, dv = g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim
    proj = dict(param_dtype=param_dtype, quantization=cfg.quantization)
    heads_init = fan_in(in_axis=0, out_axis=(1, 2))
    self.q = projection(heads_init, rngs.params(), (e, hk, dk), ("embed", "kv_heads", "head_dim"), **proj)
    self.k = projection(heads_init, rngs.params(), (e, hk, dk), ("embed", "kv_heads", "head_dim"), **proj)
    self.v = projection(heads_init, rngs.params(), (e, hv, dv), ("embed", "heads", "head_dim"), **proj)
    if g.variant == "qwen":
      self.z = projection(heads_init, rngs.params(), (e, hv, dv), ("embed", "heads", "head_dim"), **proj)
    self.b = projection(fan_in(), rngs.params(), (e, hv), ("embed", "heads"), **proj)
    low_rank = lambda size: (  # noqa: E731  x -> [size] -> every head's [size] channels
        projection(fan_in(), rngs.params(), (e, size), ("embed", "kv_lora"), **proj),
        projection(fan_in(in_axis=0, out_axis=(1, 2)), rngs.params(), (size, hv, size),
                   ("kv_lora", "heads", "head_dim"), **proj))
    if g.variant == "kimi":  # a decay per key channel and a sigmoid output gate, both low rank
      (self.f_a, self.f_b), (self.g_a, self.g_b) = low_rank(dk), low_rank(dv)
    else:
      self.a = projection(fan_in(), rngs.params(), (e, hv), ("embed", "heads"), **proj)
    conv_init = fan_in(in_axis=0, out_axis=(1, 2))  # each channel's taps: fan-in of the kernel length
    conv = lambda h, d: nnx.Param(conv_init(rngs.params(), (g.conv_kernel, h, d), param_dtype),  # noqa: E731
                                  out_sharding=(None, "kv_heads" if h == hk else "heads", "head_dim"))
    self.conv_q, self.conv_k, self.conv_v = conv(hk, dk), conv(hk, dk), conv(hv, dv)
    # Decay rates exp(a_log) spread over [1, 16] and dt_bias at 1, as transformers initialises them.
    decay = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)
    self.a_log = nnx.Param(jnp.log(decay).astype(param_dtype), out_sharding=("heads",), weight_decay=False)
    channels = ((hv, dk), ("heads", "head_dim")) if g.variant == "kimi" else ((hv,), ("heads",))
    self.dt_bias = nnx.Param(jnp.ones(channels[0], param_dtype), out_sharding=channels[1], weight_decay=False)
    self.norm = RMSNorm(dv, eps=cfg.norm_eps, param_dtype=param_dtype, compute_dtype=jnp.float32,
                        names=("head_dim",))
    self.o = projection(fan_in(in_axis=(0, 1), out_axis=2), rngs.params(), (hv, dv, e),
                        ("heads", "head_dim", "embed"), contract=2, **proj)
    self.dtype, self.precision, self.options = compute_dtype, cfg.train_precision, g

  def __call__(self, x, context, cache, options):
    """x [B, L, embed] -> ([B, L, embed], cache). `options` (the layer's attention spec and
    RoPE) do not apply: position lives in the recurrence. Through a RecurrentState cache
    (generation), each row continues its slot's sequence from its state; with the length
    split over devices (context parallelism), the pieces pass states LASP-2 style."""
    generating = isinstance(cache, RecurrentState)
    if not generating and not isinstance(cache, (caches.NoCache, caches.SimulatedKVQuantization)):
      raise ConfigError(f"a gated_deltanet layer keeps a recurrent state, not {type(cache).__name__}")
    dt, segments, positions = self.dtype, context.segment_ids, context.positions

    def project(*names):  # x through one projection, or a low-rank pair
      out = x
      for name in names:
        out = dense(out, getattr(self, name), dtype=dt, precision=self.precision)
      return checkpoint_name(out, "qkv_proj")
    kimi = self.options.variant == "kimi"
    inputs = {n: project(n) for n in ("q", "k", "v")}
    kernels = {n: getattr(self, f"conv_{n}")[...] for n in ("q", "k", "v")}
    beta = jax.nn.sigmoid(project("b").astype(jnp.float32))
    rates = jnp.exp(self.a_log[...].astype(jnp.float32))
    decay = -(rates[:, None] if kimi else rates) * jax.nn.softplus(
        project(*(("f_a", "f_b") if kimi else ("a",))).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
    if generating:  # padding neither decays nor writes the state
      mixed, histories = {}, {}
      for n in ("q", "k", "v"):
        mixed[n], histories[f"conv_{n}"] = conv_step(inputs[n], kernels[n], cache.read(f"conv_{n}", positions),
                                                     jnp.sum(positions >= 0, axis=1),
                                                     every_token=cache.speculating)
      valid = (positions >= 0)[..., None]
      decay = jnp.where(valid if decay.ndim == 3 else valid[..., None], decay, 0.0)
      beta = jnp.where(valid, beta, 0.0)
      if cache.speculating:  # a speculative window: the states after each token, as candidates
        out, states = self._each_token(*self._activate(mixed), decay, beta, cache.read("delta", positions))
        cache = cache.write({f"{name}_at": value for name, value in {**histories, "delta": states}.items()},
                            positions)
      else:
        out, state = self._continue(*self._activate(mixed), decay, beta, cache.read("delta", positions))
        cache = cache.write({**histories, "delta": state}, positions)
    elif num_shards("length") > 1:
      out = self._split_sequence(inputs, kernels, decay, beta, segments, context.zigzag)
    else:
      q, k, v = self._activate({n: causal_conv(inputs[n], kernels[n], segments) for n in inputs})
      q = constrain(q, ("batch", "length", "act_kv_heads", "head_dim"))
      k = constrain(k, ("batch", "length", "act_kv_heads", "head_dim"))
      v = constrain(v, ("batch", "length", "act_heads", "head_dim"))
      out, _ = self._rule(q, k, v, decay, beta, None, segments)
    gate = jax.nn.sigmoid(project("g_a", "g_b").astype(jnp.float32)) if kimi else \
        jax.nn.silu(project("z").astype(jnp.float32))
    out = checkpoint_name((self.norm(out) * gate).astype(dt), "attention_out")
    return checkpoint_name(dense(out, self.o, contract=2, dtype=dt, precision=self.precision), "out_proj"), cache

  def _activate(self, mixed: dict):
    """The convolved q, k, v -> SiLU; q and k L2-normalised, q scaled by key_dim^-0.5."""
    q, k, v = (jax.nn.silu(mixed[n]) for n in ("q", "k", "v"))
    return l2_normalize(q) * self.options.key_head_dim ** -0.5, l2_normalize(k), v

  def _rule(self, q, k, v, decay, beta, initial_state, segments):
    return pallas_kernels.gated_delta_rule(q, k, v, decay, beta, initial_state=initial_state, segment_ids=segments,
                                           implementation=self.options.implementation,
                                           chunk_size=self.options.chunk_size)

  def _split_sequence(self, inputs: dict, kernels: dict, decay, beta, segments, zigzag: bool):
    """Convolution and delta rule with the length split over its mesh axes: per device, inside
    a shard_map manual over those axes only (batch and heads stay the partitioner's). Each
    piece takes the last K-1 inputs of the piece before it for its convolution, and its
    starting state from the LASP-2 pass (pallas_kernels/linear_attention/sequence_parallel.py):
    two all-gathers per layer whose sizes do not depend on the length."""
    axes, shards = mesh_axes("length"), num_shards("length")
    split = dict(axes=axes, shards=shards, zigzag=zigzag)
    count, taps = 2 if zigzag else 1, self.options.conv_kernel
    piece = decay.shape[1] // (shards * count)
    if piece < taps - 1:
      raise ConfigError(f"data.seq_len={decay.shape[1]} gives each of the {shards * count} pieces over mesh axes "
                        f"{axes} {piece} tokens, fewer than the convolution's {taps - 1} of history: "
                        "use a longer sequence or fewer context devices")

    def tail(x):  # the last K-1 tokens of a piece: what the next piece's convolution reads
      return x[:, x.shape[1] - (taps - 1):]

    def local(inputs, kernels, decay, beta, segments):
      ids, history_ids = [None] * count, [None] * count
      if segments is not None:
        ids = jnp.split(segments, count, axis=1)
        history_ids = from_predecessor([tail(i) for i in ids], jnp.full_like(tail(ids[0]), -1), **split)
      mixed = {}
      for n, x in inputs.items():
        parts = jnp.split(x, count, axis=1)
        histories = from_predecessor([tail(part) for part in parts], jnp.zeros_like(tail(parts[0])), **split)
        mixed[n] = jnp.concatenate([causal_conv(part, kernels[n], ids[p], histories[p], history_ids[p])
                                    for p, part in enumerate(parts)], axis=1)
      q, k, v = self._activate(mixed)
      return gated_delta_rule_split(self._rule, q, k, v, decay, beta, segments, **split)

    sequence = PartitionSpec(None, axes)
    specs = ({n: sequence for n in inputs}, {n: PartitionSpec() for n in kernels}, sequence, sequence,
             None if segments is None else sequence)
    return jax.shard_map(local, in_specs=specs, out_specs=sequence, axis_names=set(axes), check_vma=False)(
        inputs, kernels, decay, beta, segments)

  def _continue(self, q, k, v, decay, beta, state):
    """The delta rule from each row's `state`: one token by the decode step, more (a prompt
    chunk, a speculative window) by the door's chunked form."""
    if q.shape[1] == 1:
      out, state = pallas_kernels.gated_delta_step(state, q[:, 0], k[:, 0], v[:, 0], decay[:, 0], beta[:, 0])
      return out[:, None], state
    return self._rule(q, k, v, decay, beta, state, None)

  def _each_token(self, q, k, v, decay, beta, state):
    """The delta rule token by token from each row's `state` -> (out [B, T, ...], the state
    after each token [B, heads, T, key_dim, value_dim]): the decode step's arithmetic."""
    def step(state, token):
      out, state = pallas_kernels.gated_delta_step(state, *token)
      return state, (out, state)
    _, (out, states) = jax.lax.scan(step, state, [jnp.moveaxis(x, 1, 0) for x in (q, k, v, decay, beta)])
    return jnp.moveaxis(out, 0, 1), jnp.moveaxis(states, 0, 2)

  @staticmethod
  def matmul_params(cfg) -> int:
    """Parameters of its projections (what FLOP counting multiplies by tokens)."""
    g = cfg.gated_deltanet
    key, value = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim
    if g.variant == "kimi":  # q, k, v, o, b, and the two low-rank gates
      gates = (cfg.embed_dim + key) * g.key_head_dim + (cfg.embed_dim + value) * g.value_head_dim
      return cfg.embed_dim * (2 * key + 2 * value + g.num_value_heads) + gates
    return cfg.embed_dim * (2 * key + 3 * value + 2 * g.num_value_heads)

  @staticmethod
  def mixing_flops(cfg) -> float:
    """Training FLOPs per token of the recurrence, counted as its recurrent form does them:
    per value head three [key_dim x value_dim] products (read the state for k, write the
    correction, read it for q) at 2 flops each, forward + backward (x 3)."""
    g = cfg.gated_deltanet
    return 3 * 3 * 2 * g.num_value_heads * g.key_head_dim * g.value_head_dim

  @staticmethod
  def init_cache(cfg, num_layers, num_pages, page_size, dtype, *, kv_quantization=None, slots=1):
    """Its generation cache: a fixed-size state per slot, whatever the pages
    (models/recurrent_state.py); KV quantization leaves it in float."""
    return init_states(cfg, num_layers, slots, dtype)


register_block("attention", "gated_deltanet", GatedDeltaNet)
