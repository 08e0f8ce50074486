"""GaLore (Zhao et al., 2024): Adam in a low-rank projection of each weight matrix's gradient
(`train.optimizer: galore`, keys under `train.galore`).

For a hidden weight matrix (Muon's: two or more axes besides `layers`/`experts`, no `vocab`)
with an `embed` axis, G viewed as [embed, rest]: every `update_every` steps the projection P
becomes the top `rank` left singular vectors of that step's gradient. Each step Adam's moments
are kept for R = P^T G ([rank, rest] instead of [embed, rest]) and the update is
scale * P (m / (sqrt(v) + eps)). Projecting the `embed` side is the paper's rule (the smaller
side) for every hidden matrix of a transformer, whose other side (heads x head_dim, mlp) is
at least as wide; it also keeps P split like its matrix: under FSDP, `embed` is the axis the
devices split. Everything else (embeddings, the output projection, norms, matrices without
`embed`) takes plain Adam. Weight decay and the learning rate follow, as for AdamW.

State, all in the parameter's rank so it shards like its parameter (axes of the parameter's
size split as it is, the rest whole): P as the parameter with its non-`embed` axes replaced
by (rank, 1, ...); each moment as the parameter with `embed` replaced by rank. Per matrix of
m x n: m r + 2 r n floats against AdamW's 2 m n.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpar.train.matrices import STACKED, hidden_matrix


class GaloreState(NamedTuple):
  count: jax.Array
  projection: Any  # per parameter: P ([..., embed, rank, 1, ...] in its axes) or None
  mu: Any
  nu: Any


def projected(names: tuple) -> bool:
  """Whether GaLore projects a parameter with these logical axes: a hidden weight matrix with
  one `embed` axis."""
  return hidden_matrix(names) and names.count("embed") == 1


class _Geometry:
  """One matrix parameter's axes: the stacked ones (batch), `embed` (projected), the rest."""

  def __init__(self, names: tuple, shape, rank: int):
    self.shape, self.embed = tuple(shape), names.index("embed")
    self.stacked = [i for i, n in enumerate(names) if n in STACKED]
    self.rest = [i for i in range(len(shape)) if i != self.embed and i not in self.stacked]
    self.m, self.n = shape[self.embed], math.prod(shape[i] for i in self.rest)
    self.rank = min(rank, self.m, self.n)
    self.order = self.stacked + [self.embed] + self.rest  # to [*stacked, embed, *rest]
    self.batch = tuple(shape[i] for i in self.stacked)

  def matrix(self, x):
    """[param axes] -> [*stacked, m, n]."""
    return jnp.transpose(x, self.order).reshape(*self.batch, self.m, self.n)

  def projection_shape(self):
    shape = list(self.shape)
    for k, i in enumerate(self.rest):
      shape[i] = self.rank if k == 0 else 1
    return tuple(shape)

  def moment_shape(self):
    shape = list(self.shape)
    shape[self.embed] = self.rank
    return tuple(shape)

  def projection_matrix(self, p):
    """P in the parameter's axes -> [*stacked, m, rank]."""
    return jnp.transpose(p, self.order).reshape(*self.batch, self.m, self.rank)

  def projection_param(self, p):
    """[*stacked, m, rank] -> P in the parameter's axes."""
    ordered = [self.projection_shape()[i] for i in self.order]
    return jnp.transpose(p.reshape(ordered), _inverse(self.order))

  def moment_param(self, r):
    """[*stacked, rank, n] -> the moment in the parameter's axes (rank where embed was)."""
    ordered = [self.moment_shape()[i] for i in self.order]
    return jnp.transpose(r.reshape(ordered), _inverse(self.order))

  def moment_matrix(self, r):
    return jnp.transpose(r, self.order).reshape(*self.batch, self.rank, self.n)

  def param(self, x):
    """[*stacked, m, n] -> [param axes]."""
    return jnp.transpose(x.reshape([self.shape[i] for i in self.order]), _inverse(self.order))


def _inverse(order):
  return [order.index(i) for i in range(len(order))]


def top_left_singular_vectors(g, rank: int):
  """[..., m, n] -> [..., m, rank]: the left singular vectors of the `rank` largest values."""
  u, _, _ = jnp.linalg.svd(g.astype(jnp.float32), full_matrices=False)
  return u[..., :rank]


def scale_by_galore(axis_names, *, rank: int, update_every: int, scale: float, b1: float, b2: float,
                    eps: float) -> optax.GradientTransformation:
  """Adam's direction, with the moments of every projected matrix (projected_axes) kept in its
  rank-`rank` projection, refreshed every `update_every` steps. Chain weight decay and the
  learning rate after it. axis_names: the parameters' logical axis names (Runtime.axis_names)."""
  def geometries(params):
    return jax.tree.map(lambda p, names: _Geometry(names, p.shape, rank) if projected(names) else None,
                        params, axis_names)

  def init(params):
    shapes = geometries(params)
    leaves, tree = jax.tree.flatten(params)
    found = tree.flatten_up_to(shapes)
    projection = [None if g is None else jnp.zeros(g.projection_shape(), jnp.float32) for g in found]
    moments = [jnp.zeros(p.shape if g is None else g.moment_shape(), jnp.float32) for p, g in zip(leaves, found)]
    return GaloreState(jnp.zeros([], jnp.int32), tree.unflatten(projection), tree.unflatten(moments),
                       tree.unflatten(moments))

  def update(updates, state, params=None):
    leaves, tree = jax.tree.flatten(updates)
    found = tree.flatten_up_to(geometries(updates))
    refresh = state.count % update_every == 0
    count = state.count + 1
    corrected = lambda x, beta: x / (1 - beta ** count.astype(jnp.float32))  # noqa: E731
    new_p, new_mu, new_nu, out = [], [], [], []
    for g, geometry, p, mu, nu in zip(leaves, found, tree.flatten_up_to(state.projection),
                                      tree.flatten_up_to(state.mu), tree.flatten_up_to(state.nu)):
      g = g.astype(jnp.float32)
      if geometry is None:
        r = g
      else:
        matrix = geometry.matrix(g)
        held = geometry.projection_matrix(p)
        p_matrix = jax.lax.cond(refresh, lambda: top_left_singular_vectors(matrix, geometry.rank), lambda: held)
        r = geometry.moment_param(jnp.einsum("...mr,...mn->...rn", p_matrix, matrix))
      mu = b1 * mu + (1 - b1) * r
      nu = b2 * nu + (1 - b2) * jnp.square(r)
      direction = corrected(mu, b1) / (jnp.sqrt(corrected(nu, b2)) + eps)
      if geometry is not None:
        direction = scale * geometry.param(
            jnp.einsum("...mr,...rn->...mn", p_matrix, geometry.moment_matrix(direction)))
        p = geometry.projection_param(p_matrix)
      new_p.append(p)
      new_mu.append(mu)
      new_nu.append(nu)
      out.append(direction)
    return tree.unflatten(out), GaloreState(count, tree.unflatten(new_p), tree.unflatten(new_mu),
                                            tree.unflatten(new_nu))

  return optax.GradientTransformation(init, update)
