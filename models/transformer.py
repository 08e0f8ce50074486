"""A decoder-only language model: embedding -> layer stack(s) -> final norm -> projection.

Pure model code: arrays carry logical axis names; no mesh axes, no collectives. The layer
is the config's registered `model.layer_block`, around its `model.attention_block` and
feed-forward block (`model.mlp`); with `model.first_dense_layers` the first layers use the
dense block instead, as their own scanned group. Each layer gets its static options from
`model.layer_pattern` (layer_pattern.py), by its index over the whole stack; a pattern that
gives some layers another token mixer (a hybrid's linear-attention layers) stacks those
layers apart, and the groups of one run interleave in the scan (stack.run_stacks).
"""

import zlib
from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx

from jaxpar import pallas_kernels
from jaxpar.errors import ConfigError
from jaxpar.mesh import constrain, num_shards
from jaxpar.models import caches, low_precision
from jaxpar.models.decoder import RESIDUAL, LayerContext
from jaxpar.models.embedding import embed_lookup
from jaxpar.models.init import embedding_init, fan_in
from jaxpar.models.layer_pattern import layer_mixer, local_window, sliding_windows, unit_options
from jaxpar.models.medusa import MedusaHeads
from jaxpar.models.norm import RMSNorm
from jaxpar.models.per_layer_inputs import PerLayerInputs
from jaxpar.models.registry import get_block
from jaxpar.models.pipeline import run_group
from jaxpar.models.stack import create_layers, run_stacks, with_remat


class LayerGroup(NamedTuple):
  """Layers with the same parameter structure, stacked and scanned together."""
  name: str  # the model attribute (and the parameter path's first key)
  indices: tuple[int, ...]  # its layers' indices in the whole stack, in order
  feed_forward: str  # its feed-forward block
  mixer: str  # its token mixer (attention block)
  run: str  # the groups of one run interleave (a hybrid's mixers); runs go one after another

  @property
  def count(self) -> int:
    return len(self.indices)


# The group a pipeline runs over its stages (`mesh.stage > 1`): the repeated layers. The
# groups before it (dense first layers) run before the pipeline, on every stage.
PIPELINED_GROUP = "layers"


def layer_groups(cfg) -> list[LayerGroup]:
  """The scanned groups, in order: per run (`dense_layers` then `layers`), one group per
  token mixer, the model's attention block keeping the run's name (`gated_deltanet_layers`
  beside `layers`)."""
  dense = cfg.first_dense_layers
  groups = []
  for run, indices, feed_forward in (("dense_layers", range(dense), "dense"),
                                     ("layers", range(dense, cfg.num_layers), cfg.mlp)):
    by_mixer = {}
    for i in indices:
      by_mixer.setdefault(layer_mixer(cfg, i), []).append(i)
    groups += [LayerGroup(run if mixer == cfg.attention_block else f"{mixer}_{run}", tuple(layers),
                          feed_forward, mixer, run) for mixer, layers in by_mixer.items()]
  return groups


def kv_sources(cfg) -> dict[str, tuple[str, tuple[int, ...]]]:
  """{group whose layers reuse an earlier layer's keys and values (their block's
  `kv_source_mixer`, Gemma 4's KV sharing): (the group they read, and per layer the index in
  it of the last earlier layer of that mixer)}."""
  groups, sources = layer_groups(cfg), {}
  for group in groups:
    mixer = getattr(get_block("attention", group.mixer), "kv_source_mixer", None)
    if mixer is not None:
      source = next(g for g in groups if g.mixer == mixer and g.run == group.run)
      sources[group.name] = (source.name, tuple(max(j for j, s in enumerate(source.indices) if s < i)
                                                for i in group.indices))
  return sources


def layer_runs(cfg) -> list[list[LayerGroup]]:
  """The groups by run, in order: each run's layers are consecutive, its groups interleaved."""
  runs = {}
  for group in layer_groups(cfg):
    runs.setdefault(group.run, []).append(group)
  return list(runs.values())


def reduce_aux(per_group: list[dict]) -> dict:
  """Per-layer aux outputs ({"losses": {...}, "metrics": {...}}, stacked over each group's
  layers) -> losses summed over all layers, metrics averaged over the layers that have them."""
  losses, metrics, counts = {}, {}, {}
  for aux in per_group:
    for name, value in aux.get("losses", {}).items():
      losses[name] = losses.get(name, 0.0) + jnp.sum(value, axis=0)
    for name, value in aux.get("metrics", {}).items():
      metrics[name] = metrics.get(name, 0.0) + jnp.sum(value, axis=0)
      counts[name] = counts.get(name, 0) + value.shape[0]
  return {"losses": losses, "metrics": {k: v / counts[k] for k, v in metrics.items()}}


def init_cache(cfg, num_pages: int, page_size: int, dtype, *, kv_quantization=None, slots: int = 1,
               kv_repeat: int = 1) -> dict:
  """A zeroed paged KV cache for every layer group of model section `cfg`; with
  `kv_quantization`, the quantized layout (pages in the pool quantized, one float tail page
  per slot). A group that mixes local and global layers keeps `num_pages` for its global
  layers and a ring of the window's pages per slot for its local ones (kv_cache_windowed.py),
  as does a group of local layers only in a model with global layers. `kv_repeat`: copies of
  each KV head kept (kv_cache.head_repeat)."""
  return {g.name: caches.init(cfg, g.count, num_pages, page_size, dtype, kv_quantization=kv_quantization,
                              slots=slots, windows=sliding_windows(cfg, g.indices), mixer=g.mixer,
                              kv_repeat=kv_repeat, rings=local_window(cfg) is not None)
          for g in layer_groups(cfg)}


class Transformer(nnx.Module):
  """tokens int [B, L] ("batch", "length") -> logits [B, L, vocab] plus auxiliary outputs.

  Parameters: embed [vocab, embed]; the layers, stacked with a leading `layers` axis when
  `scan_layers`; final_norm; unembed [embed, vocab] unless `tie_embeddings`.
  """

  def __init__(self, cfg, rngs: nnx.Rngs):
    self.cfg = cfg
    param_dtype, compute_dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
    self.embed = nnx.Param(embedding_init(cfg.embed_dim)(rngs.params(), (cfg.vocab_size, cfg.embed_dim), param_dtype),
                           out_sharding=("vocab", "embed"))
    make_layer = get_block("decoder_layer", cfg.layer_block)
    for group in layer_groups(cfg):
      layer = lambda r, g=group: make_layer(cfg, r, feed_forward=g.feed_forward, mixer=g.mixer)  # noqa: E731
      setattr(self, group.name, create_layers(layer, group.count, rngs, scan=cfg.scan_layers))
    self.final_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, param_dtype=param_dtype,
                              compute_dtype=compute_dtype, unit_offset=cfg.norm_unit_offset)
    if not cfg.tie_embeddings:
      self.unembed = nnx.Param(fan_in()(rngs.params(), (cfg.embed_dim, cfg.vocab_size), param_dtype),
                               out_sharding=("embed", "vocab"))
    if cfg.per_layer_input_dim:
      self.per_layer_inputs = PerLayerInputs(cfg, rngs)
    if cfg.medusa is not None:  # draft heads over the final hidden state (speculative decoding)
      self.medusa = MedusaHeads(cfg, rngs)

  def __call__(self, tokens, positions=None, segment_ids=None, kv_quantization=None, *, zigzag=False):
    """-> (logits [B, L, vocab] in the compute dtype, aux {"losses", "metrics"}); the
    arguments are `hidden_states`'."""
    x, aux = self.hidden_states(tokens, positions, segment_ids, kv_quantization, zigzag=zigzag)
    return constrain(self.logits(x), ("batch", "length", "act_vocab")), aux

  def logits(self, hidden):
    """Final hidden states [..., embed] -> logits [..., vocab] (soft-capped when the model
    says: `model.final_logit_soft_cap`)."""
    logits = jnp.einsum("...e,ev->...v", hidden, self.output_projection())
    cap = self.cfg.final_logit_soft_cap
    return logits if cap is None else cap * jnp.tanh(logits / cap)

  def output_projection(self):
    """The [embed, vocab] matrix that turns final hidden states into logits."""
    unembed = self.embed[...].T if self.cfg.tie_embeddings else self.unembed[...]
    return unembed.astype(jnp.dtype(self.cfg.compute_dtype))

  def hidden_states(self, tokens, positions=None, segment_ids=None, kv_quantization=None, *, zigzag=False):
    """Final-normed hidden states [B, L, embed] and aux: the logits before the output
    projection, for losses that never materialise the full [B, L, vocab] logits.

    kv_quantization (a kv_quant.KVQuantization): attend as through that quantized cache.
    zigzag: the length axis (tokens, positions, segment ids) is in zig-zag order over the
    devices that split it (`pallas_kernels.zigzag`), as the train step lays it out to
    balance causal attention; the outputs are in that order too."""
    x, aux, _ = self.stack_output(tokens, positions, segment_ids, kv_quantization, zigzag=zigzag)
    return self.final_norm(x), aux

  def stack_output(self, tokens, positions=None, segment_ids=None, kv_quantization=None, *, zigzag=False):
    """The last layer's output [B, L, embed] before the final norm, aux, and the layers'
    LayerContext: what `hidden_states` normalises (and multi-token prediction starts from)."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
      if zigzag:
        positions = pallas_kernels.zigzag(positions, num_shards("length"))
    x = self._embed(tokens)
    context = self._with_layer_inputs(LayerContext(positions, segment_ids, zigzag=zigzag), tokens, x)
    cache = caches.for_forward(kv_quantization)
    group_caches = {g.name: cache for g in layer_groups(self.cfg)}
    x, aux, _ = self._run_stack(x, context, {**group_caches, **self._kept_keys(tokens.shape, kv_quantization)})
    return x, aux, context

  def _kept_keys(self, shape, kv_quantization) -> dict:
    """The caches of the groups whose keys and values later layers reuse, for a full
    forward of tokens of `shape` [B, L] (none when no layer reuses any)."""
    self._check_kv_sharing(kv_quantization)
    cfg, kept = self.cfg, {}
    for source, _ in kv_sources(cfg).values():
      own = get_block("attention", next(g.mixer for g in layer_groups(cfg) if g.name == source)).layer_config(cfg)
      zeros = jnp.zeros((*shape, own.num_kv_heads, own.head_dim), jnp.dtype(cfg.compute_dtype))
      kept[source] = caches.KeptKeys(zeros, zeros)
    return kept

  def _check_kv_sharing(self, kv_quantization):
    if kv_quantization is not None and kv_sources(self.cfg):
      raise ConfigError("layers that reuse another layer's keys and values (Gemma 4's KV sharing) read a float "
                        "cache: serve and evaluate this model without KV quantization")

  def decode(self, tokens, positions, cache: dict, page_table, logits_index=None, *,
             kv_quantization=None, tail_index=None):
    """Generation: new tokens [B, T] at positions [B, T] (negative: padding) through the
    paged KV cache {group: {"k", "v"}} -> (logits, updated cache). Logits are
    [B, T, vocab], or [B, vocab] at each row's `logits_index` [B] when given. With
    `kv_quantization` the cache is the quantized layout (`init_cache(...,
    kv_quantization=)`) and `tail_index` [B] names each row's slot."""
    x, cache = self.decode_hidden(tokens, positions, cache, page_table, kv_quantization, tail_index)
    if logits_index is not None:
      x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
    return self.logits(x), cache

  def prefill_cache(self, tokens, positions, cache: dict, page_table, *, kv_quantization=None,
                    tail_index=None) -> dict:
    """Only write the new tokens' keys and values into the cache (no logits): prefill."""
    return self.decode_hidden(tokens, positions, cache, page_table, kv_quantization, tail_index)[1]

  def decode_hidden(self, tokens, positions, cache, page_table, kv_quantization=None, tail_index=None, *,
                    tree=None, rope_positions=None):
    """`decode`'s final-normed hidden states [B, T, embed] before the output projection, and
    the updated cache (a draft source's heads read them). A speculative tree pass gives
    `tree` (a TreeMask over the T tokens), `positions` their cache slots (consecutive per
    row) and `rope_positions` their places in the sequence (LayerContext)."""
    x, cache = self.decode_stack(tokens, positions, cache, page_table, kv_quantization, tail_index, tree=tree,
                                 rope_positions=rope_positions)
    return self.final_norm(x), cache

  def decode_stack(self, tokens, positions, cache, page_table, kv_quantization=None, tail_index=None, *,
                   tree=None, rope_positions=None):
    """`decode_hidden` before the final norm: the last layer's output [B, T, embed] (what
    multi-token prediction starts from), and the updated cache (groups that are not the
    stack's, a draft's own, pass through)."""
    if tree is not None and kv_quantization is not None:
      raise ConfigError("a speculative tree pass writes candidates past a row's end, which a quantized cache's "
                        "tail page cannot hold: serve with a float KV cache, or with a chain (no tree)")
    self._check_kv_sharing(kv_quantization)
    first = jnp.zeros((), jnp.int32)
    windows = {g.name: sliding_windows(self.cfg, g.indices) for g in layer_groups(self.cfg)}
    views = {name: caches.for_generation(pages, page_table, first, kv_quantization=kv_quantization,
                                         tail_index=tail_index, windows=windows[name])
             for name, pages in cache.items() if name in windows}
    x = self._embed(tokens)
    context = self._with_layer_inputs(LayerContext(positions, rope_positions=rope_positions, tree=tree), tokens, x)
    x, _, views = self._run_stack(x, context, views)
    return x, {**cache, **{name: view.pages for name, view in views.items()}}

  def init_cache(self, num_pages: int, page_size: int, dtype=None, *, kv_quantization=None,
                 slots: int = 1, kv_repeat: int = 1) -> dict:
    """A zeroed paged KV cache for every layer group (`init_cache`)."""
    return init_cache(self.cfg, num_pages, page_size, dtype or jnp.dtype(self.cfg.compute_dtype),
                      kv_quantization=kv_quantization, slots=slots, kv_repeat=kv_repeat)

  def _embed(self, tokens):
    table = self.embed[...].astype(jnp.dtype(self.cfg.compute_dtype))
    x = embed_lookup(table, tokens)
    if self.cfg.scale_embeddings:  # the factor rounded to the parameters' dtype, as Gemma does
      x = x * jnp.asarray(self.cfg.embed_dim ** 0.5, self.embed.dtype).astype(x.dtype)
    return constrain(x, RESIDUAL)

  def _with_layer_inputs(self, context, tokens, x):
    """The context with every layer's per-layer input, when the model has them."""
    if not self.cfg.per_layer_input_dim:
      return context
    return context.replace(layer_inputs=self.per_layer_inputs(tokens, x))

  def _run_stack(self, x, context, group_caches: dict):
    """Every layer group in order -> (x, reduced aux, the groups' caches).

    A group's cache rides in the scan carry with the activations and each layer updates its
    own slice in place: as a scanned input and output it would be sliced and restacked,
    copying the whole cache at every decode step.
    """
    cfg = self.cfg
    per_group, new_caches = [], {}
    for run in layer_runs(cfg):
      start = min(g.indices[0] for g in run)
      group_of = {g.mixer: g.name for g in run}
      kinds = unit_options(cfg, start, sum(g.count for g in run))
      unit = [(group_of[layer_mixer(cfg, start + i)], options) for i, options in enumerate(kinds)]
      layer_fns = [(name, self._layer_fn(options, name)) for name, options in unit]
      # The context rides in the carry: a pipeline streams each microbatch's with it.
      carry = (x, context, {g.name: group_caches[g.name] for g in run})
      if len(run) == 1:
        (x, _, run_caches), aux = run_group(
            getattr(self, run[0].name), [fn for _, fn in layer_fns], carry, jnp.arange(run[0].count),
            scan=cfg.scan_layers, unroll=cfg.scan_unroll, pipelined=run[0].name == PIPELINED_GROUP)
        aux = [aux]
      else:  # a hybrid: its groups interleave (the parallel plan refuses a pipeline over them)
        (x, _, run_caches), by_group = run_stacks(
            {g.name: getattr(self, g.name) for g in run}, layer_fns, carry,
            {g.name: jnp.arange(g.count) for g in run}, scan=cfg.scan_layers, unroll=cfg.scan_unroll)
        aux = list(by_group.values())
      new_caches.update(run_caches)
      per_group += aux
    return x, reduce_aux(per_group), new_caches

  def _layer_fn(self, options, group: str):
    """The per-layer function of `group`'s layers with these static options (stack.run_stacks)."""
    block = with_remat(lambda layer, x, context, cache: layer(x, context, cache, options), self.cfg.remat)

    salt = zlib.crc32(group.encode()) % 2**31  # the groups' layers count from 0 each
    indices = next(g.indices for g in layer_groups(self.cfg) if g.name == group)
    # A group that reuses another's keys and values reads that group's cache at each of its
    # layers' source, and leaves it as it was.
    source, source_index = kv_sources(self.cfg).get(group, (group, None))

    def layer_fn(layer, carry, index):
      x, context, group_caches = carry
      own = context if context.layer_inputs is None else context.replace(layer_index=jnp.asarray(indices)[index])
      at = index if source_index is None else jnp.asarray(source_index)[index]
      with low_precision.noise_scope(salt, index):  # each layer its own gradient rounding noise
        x, aux, cache = block(layer, x, own, group_caches[source].at(at))
      return (x, context, group_caches if source_index is not None else {**group_caches, group: cache}), aux
    return layer_fn
