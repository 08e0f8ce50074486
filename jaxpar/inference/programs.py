"""The device programs of generation, compiled ahead of time for fixed shapes.

`step` feeds one new token per slot through the model and the paged KV cache and samples
each slot's next token (decode); `fill` only writes a chunk of prompt tokens into the cache
(prefill); `score` returns every position's logits for several new tokens per row (the
target's verify pass in speculative decoding). The cache is donated, so it is updated in
place. Every shape is compiled at start-up; calling with another shape is an error rather
than a silent recompile.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.inference.sampling import sample
from jaxpar.mesh import logical_to_sharding

SETTINGS = {"temperature": jnp.float32, "top_k": jnp.int32, "top_p": jnp.float32, "seed": jnp.uint32}


def _step(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings):
  model = nnx.merge(graphdef, params, model_state)
  first = jnp.zeros(tokens.shape[:1], jnp.int32)
  logits, cache = model.decode(tokens, positions, cache, page_table, logits_index=first,
                               kv_quantization=kv, tail_index=rows)
  next_tokens, logprobs = sample(logits, settings, positions[:, 0] + 1)
  return next_tokens, logprobs, cache


def _fill(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows):
  return nnx.merge(graphdef, params, model_state).prefill_cache(tokens, positions, cache, page_table,
                                                                kv_quantization=kv, tail_index=rows)


def _score(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows):
  logits, cache = nnx.merge(graphdef, params, model_state).decode(tokens, positions, cache, page_table,
                                                                  kv_quantization=kv, tail_index=rows)
  return logits.astype(jnp.float32), cache


_KINDS = {"step": _step, "fill": _fill, "score": _score}


def _struct(x, sharding=None):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding)


class Programs:
  """Compiled executables for one runtime, parameter layout and cache layout."""

  def __init__(self, runtime, params, model_state, cache, kv_quantization=None):
    self.runtime, self.kv_quantization = runtime, kv_quantization
    self._state = (jax.tree.map(_struct, params), jax.tree.map(_struct, model_state),
                   jax.tree.map(_struct, cache))
    self._cache_shardings = jax.tree.map(lambda x: x.sharding, cache)
    self.compiled = {}

  def _rows(self, batch: int):
    """Shardings of per-row arrays: rows over the batch axes when they divide them."""
    mesh = self.runtime.mesh
    spec = (logical_to_sharding(("batch",), (batch,), mesh, self.runtime.rules).spec
            if batch > 1 else PartitionSpec())
    return NamedSharding(mesh, spec), NamedSharding(mesh, PartitionSpec(*(tuple(spec) or (None,)), None))

  def compile(self, kind: str, batch: int, length: int, pages_per_seq: int):
    rows, matrix = self._rows(batch)
    args = [jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=matrix),
            jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=matrix),
            jax.ShapeDtypeStruct((batch, pages_per_seq), jnp.int32, sharding=matrix),
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)]  # each row's slot
    if kind == "step":
      args.append({k: jax.ShapeDtypeStruct((batch,), dtype, sharding=rows) for k, dtype in SETTINGS.items()})
    out = {"step": (rows, rows, self._cache_shardings), "fill": self._cache_shardings,
           "score": (None, self._cache_shardings)}[kind]
    fn = functools.partial(_KINDS[kind], self.runtime.graphdef, self.kv_quantization)
    with self.runtime.context():
      jitted = jax.jit(fn, out_shardings=out, donate_argnums=(2,))
      self.compiled[kind, batch, length] = jitted.lower(*self._state, *args).compile()

  def run(self, kind: str, params, model_state, cache, *rows):
    """Call a compiled program; host arrays go where it was compiled to expect them."""
    batch, length = rows[0].shape
    executable = self.compiled[kind, batch, length]
    placed = jax.device_put(list(rows), list(executable.input_shardings[0][3:]))
    return executable(params, model_state, cache, *placed)
