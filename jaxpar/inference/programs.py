"""The device programs of generation, compiled ahead of time for fixed shapes.

`step` feeds one new token per slot through the model and the paged KV cache and samples
each slot's next token (decode); `fill` only writes a chunk of prompt tokens into the cache
(prefill). Other modules add their own `Kind`s (speculative decoding's draft and target
rounds). The cache is donated, so it is updated in place. Every shape is compiled at start-up; calling with another shape is an error rather
than a silent recompile.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.inference.sampling import sample
from jaxpar.mesh import logical_to_sharding
from jaxpar.models import lora
from jaxpar.runtime import abstract_model

SETTINGS = {"temperature": jnp.float32, "top_k": jnp.int32, "top_p": jnp.float32, "seed": jnp.uint32,
            "logprobs": jnp.bool_}


def _step(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings):
  model = nnx.merge(graphdef, params, model_state)
  first = jnp.zeros(tokens.shape[:1], jnp.int32)
  logits, cache = model.decode(tokens, positions, cache, page_table, logits_index=first,
                               kv_quantization=kv, tail_index=rows)
  next_tokens, logprobs = sample(logits, settings, positions[:, 0] + 1)
  return next_tokens, logprobs, cache


def _single_step(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings):
  """One decode step with tokens and log-probabilities [B, 1]: its tokens are the next step's
  input as they are (the engine's run-ahead feeds them back without the host)."""
  next_tokens, logprobs, cache = _step(graphdef, kv, params, model_state, cache, tokens, positions, page_table,
                                       rows, settings)
  return next_tokens[:, None], logprobs[:, None], cache


def _fill(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows):
  return nnx.merge(graphdef, params, model_state).prefill_cache(tokens, positions, cache, page_table,
                                                                kv_quantization=kv, tail_index=rows)


@dataclasses.dataclass(frozen=True)
class Kind:
  """A program: body(graphdef, kv_quantization, params, model_state, cache, tokens, positions,
  page_table, rows, *extra) returning its outputs then the cache; `extra(batch, length, vocab)`
  gives the other arguments' shapes and dtypes (each row-major: sharded by its first axis);
  `outputs` says which outputs are per row (sharded like the rows) and which are not."""
  body: Callable
  extra: Callable = lambda batch, length, vocab: ()
  outputs: tuple[str | None, ...] = ()


def settings_struct(batch: int) -> dict:
  """Each row's sampling settings (`sampling.row_arrays`)."""
  return {k: jax.ShapeDtypeStruct((batch,), dtype) for k, dtype in SETTINGS.items()}


def settings_extra(batch, *_):
  """`Kind.extra` of programs that take only the rows' sampling settings."""
  return (settings_struct(batch),)


def burst_kind(steps: int) -> Kind:
  """`steps` decode steps in one call, each feeding the tokens it samples to the next: one
  dispatch and one host round trip per burst. Outputs tokens and log-probabilities
  [batch, steps]; idle rows (position -1) stay idle."""
  def burst(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings):
    def one(carry, _):
      tokens, positions, cache = carry
      sampled, logprobs, cache = _step(graphdef, kv, params, model_state, cache, tokens, positions,
                                       page_table, rows, settings)
      positions = jnp.where(positions >= 0, positions + 1, positions)
      return (sampled[:, None], positions, cache), (sampled, logprobs)
    (*_, cache), (sampled, logprobs) = jax.lax.scan(one, (tokens, positions, cache), length=steps)
    return sampled.T, logprobs.T, cache
  return Kind(burst, settings_extra, ("rows", "rows"))


KINDS = {"step": Kind(_single_step, settings_extra, ("rows", "rows")),
         "fill": Kind(_fill)}


def _struct(x, sharding=None):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding)


def _rolled_graphdef(runtime):
  """The model's graphdef with its layer loop rolled (`scan_unroll` 1), whatever training
  unrolls: the same parameters, but generation's small steps ran slower unrolled (the
  bench-20m decode step on CPU took 13-30% more CPU time at batch 1, 8 and 32 with its
  4 layers unrolled than as a loop)."""
  cfg = runtime.model_config
  if not cfg.scan_layers or cfg.scan_unroll == 1:
    return runtime.graphdef
  return abstract_model(cfg.model_copy(update={"scan_unroll": 1}))[0]


def program_key(kind: str, rows) -> tuple:
  """(kind, batch, length, page-table width): what a call's per-row arguments need compiled."""
  return (kind, *rows[0].shape, rows[2].shape[1])


def _rows_pick_adapters(body):
  """`body` taking each row's stacked adapter (int32 [batch]) after its slot (model.lora.stacked)."""
  def picking(params, model_state, cache, tokens, positions, page_table, rows, adapters, *extra):
    with lora.rows_use_adapters(adapters):
      return body(params, model_state, cache, tokens, positions, page_table, rows, *extra)
  return picking


class Programs:
  """Compiled executables for one runtime, parameter layout and cache layout. With stacked
  adapters (model.lora.stacked), every program takes each row's adapter after its slot."""

  def __init__(self, runtime, params, model_state, cache, kv_quantization=None):
    self.runtime, self.kv_quantization = runtime, kv_quantization
    lora_config = runtime.model_config.lora
    self.stacked = lora_config is not None and lora_config.stacked > 0
    self.graphdef = _rolled_graphdef(runtime)
    self._state = (jax.tree.map(_struct, params), jax.tree.map(_struct, model_state),
                   jax.tree.map(_struct, cache))
    self._cache_shardings = jax.tree.map(lambda x: x.sharding, cache)
    self.compiled = {}
    self._row_shardings = {}  # what each program expects of its per-row arguments

  def _rows(self, batch: int) -> NamedSharding:
    """Sharding of per-row arrays: rows over the batch axes when they divide them."""
    spec = (logical_to_sharding(("batch",), (batch,), self.runtime.mesh, self.runtime.rules).spec
            if batch > 1 else PartitionSpec())
    return NamedSharding(self.runtime.mesh, spec)

  @property
  def state_shardings(self) -> tuple:
    """(params, model_state) shardings the programs were compiled for."""
    return tuple(jax.tree.map(lambda x: x.sharding, tree) for tree in self._state[:2])

  def compile(self, kind: str, batch: int, length: int, pages_per_seq: int, program: Kind | None = None):
    """Compile `kind` (one of KINDS, or any name for `program`) for [batch, length] tokens
    and page tables [batch, pages_per_seq]."""
    rows = self._rows(batch)
    mesh = self.runtime.mesh

    def row_major(shape, dtype):  # sharded like the rows: over their first axis
      spec = PartitionSpec(*(tuple(rows.spec) or (None,)), *([None] * (len(shape) - 1)))
      return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    args = [row_major((batch, length), jnp.int32),
            row_major((batch, length), jnp.int32),
            row_major((batch, pages_per_seq), jnp.int32),
            row_major((batch,), jnp.int32)]  # each row's slot
    args += [row_major((batch,), jnp.int32)] if self.stacked else []  # each row's adapter
    program = program or KINDS[kind]
    args += jax.tree.map(lambda x: row_major(x.shape, x.dtype),
                         program.extra(batch, length, self.runtime.model_config.vocab_size))
    # Several processes: per-row outputs replicated, so process 0 reads every row (lockstep.py).
    row_out = rows if jax.process_count() == 1 else NamedSharding(mesh, PartitionSpec())
    per_row = tuple(row_out if o == "rows" else None for o in program.outputs)
    out = (*per_row, self._cache_shardings) if per_row else self._cache_shardings
    fn = functools.partial(program.body, self.graphdef, self.kv_quantization)
    fn = _rows_pick_adapters(fn) if self.stacked else fn
    with self.runtime.context():
      jitted = jax.jit(fn, out_shardings=out, donate_argnums=(2,))
      executable = jitted.lower(*self._state, *args).compile()
    self.compiled[kind, batch, length, pages_per_seq] = executable
    self._row_shardings[kind, batch, length, pages_per_seq] = executable.input_shardings[0][3:]

  def run(self, kind: str, params, model_state, cache, *rows):
    """Call a compiled program. Host arrays go straight in: the executable places them as it
    was compiled to expect (a device_put first costs ~0.4 ms more per call on CPU). A device
    array laid out otherwise (another engine's output: a speculative draft's) is moved first."""
    key = program_key(kind, rows)
    rows = [jax.device_put(x, want) if isinstance(x, jax.Array) and x.sharding != want else x
            for x, want in zip(rows, self._row_shardings[key])]
    return self.compiled[key](params, model_state, cache, *rows)
