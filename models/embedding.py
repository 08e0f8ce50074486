"""Token embedding lookup whose gradient lands in the table's own layout."""

import functools

import jax
import jax.numpy as jnp

from jaxpar.mesh import constrain

_LOOKUP = ("vocab", "act_embed")  # split only by vocab: each device looks up the rows it holds
_TABLE = ("vocab", "embed")  # the parameter's layout


def embed_lookup(table, tokens):
  """table [vocab, embed], tokens int [...] -> rows [..., embed].

  Forward: the table split only by vocab, so each device looks up the rows it holds and the
  partial rows are summed, instead of resharding the whole table. Backward: the rows'
  gradient is scattered into a table laid out as the parameter is (embed split over fsdp),
  never into a replicated table that every device would all-reduce whole.
  """
  return _lookup((table.shape, table.dtype), table, tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(table_type, table, tokens):
  return constrain(table, _LOOKUP)[tokens]


def _forward(table_type, table, tokens):
  return _lookup(table_type, table, tokens), tokens


def _backward(table_type, tokens, d_rows):
  shape, dtype = table_type
  d_table = constrain(jnp.zeros(shape, dtype), _TABLE).at[tokens].add(d_rows.astype(dtype))
  return constrain(d_table, _TABLE), None


_lookup.defvjp(_forward, _backward)
