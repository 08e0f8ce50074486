"""Candidate trees for speculative decoding: the tree pass's logits at every node equal a plain
forward of that node's path, the acceptance test keeps the target's distribution (chi-square),
and trees are grown from per-head accuracies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import MeshConfig, ModelConfig, load_config
from jaxpar.errors import ConfigError
from jaxpar.inference.draft_tree import DraftTree, choose_tree, verify_tree
from jaxpar.models.caches import copy_positions
from jaxpar.runtime import Runtime
from tests.helpers import SMALL_MODEL

CHI2_999 = {5: 20.52}
TREE = DraftTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))


def test_tree_structure():
  assert TREE.parents == (-1, 0, 0, 1, 1, 2, 3) and TREE.depth == 3 and TREE.top_k == 2
  assert TREE.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
  assert TREE.children().tolist() == [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]]
  assert TREE.mask.ancestry()[6].tolist() == [True, True, False, True, False, False, True]
  with pytest.raises(ConfigError, match="parent"):
    DraftTree(((0,), (1, 0)))


def test_choose_tree_grows_the_likeliest_paths():
  accuracy = [[0.6, 0.2, 0.15], [0.5, 0.2, 0.1]]
  # 0.6, then (0,0) 0.3 beats (1,) 0.2; then (2,) 0.15 and (0,1) 0.12 over (1,0) 0.1.
  assert choose_tree(accuracy, 3).paths == ((0,), (1,), (0, 0))
  assert choose_tree(accuracy, 5).paths == ((0,), (1,), (2,), (0, 0), (0, 1))


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_tree_pass_logits_equal_a_forward_of_each_path(family):
  """A context in the paged cache, then one pass over [root, *nodes] under the tree mask: each
  node's logits are a plain forward's of the context and that node's path (f32, 1e-5). Also
  over multi-head latent attention's cache and routed experts (tiny-deepseek, its router bias
  held still: an eager forward would update it between the calls compared)."""
  cfg = (ModelConfig(**{**SMALL_MODEL, "max_seq_len": 64}) if family == "llama" else
         load_config("tiny-deepseek", ["model.max_seq_len=64", "data.seq_len=32", "model.num_layers=2",
                                       "model.moe.bias_update_rate=0"]).model)
  runtime = Runtime(cfg, MeshConfig(fsdp=1), jax.devices()[:1])
  model = runtime.merge(*runtime.init())
  rng = np.random.default_rng(0)
  context = rng.integers(0, 256, 11).tolist()
  nodes = rng.integers(0, 256, TREE.nodes).tolist()
  table = jnp.arange(8, dtype=jnp.int32)[None]
  cache = model.init_cache(8, 8)
  n = len(context)
  _, cache = model.decode_hidden(jnp.asarray([context[:-1]]), jnp.arange(n - 1)[None], cache, table)
  slots = jnp.arange(n - 1, n + TREE.nodes)[None]
  hidden, cache = model.decode_hidden(jnp.asarray([[context[-1], *nodes]]), slots, cache, table, tree=TREE.mask,
                                      rope_positions=n - 1 + jnp.asarray(TREE.depths)[None])
  tree_logits = np.asarray(model.logits(hidden))[0]
  # Keeping path (1,) -> (1, 0) (pass indices 2, 5): moved after the root, decoding on from
  # them equals a plain forward of context + those two tokens + the next.
  cache = copy_positions(cache, table, jnp.asarray([[n - 1 + 2, n - 1 + 5]]), jnp.asarray([[n, n + 1]]))
  following = 7
  logits, _ = model.decode(jnp.asarray([[following]]), jnp.asarray([[n + 2]]), cache, table)
  # Every path and the moved one in one forward, right-padded (causal: padding after a
  # sequence's last token changes nothing before it).
  paths = []
  for index in range(TREE.nodes + 1):
    ancestors, i = [], index
    while i > 0:
      ancestors.insert(0, nodes[i - 1])
      i = TREE.parents[i]
    paths.append(context + ancestors)
  paths.append(context + [nodes[1], nodes[4], following])
  width = max(len(p) for p in paths)
  plain = np.asarray(model(jnp.asarray([p + [0] * (width - len(p)) for p in paths]))[0])
  last = [len(p) - 1 for p in paths]
  np.testing.assert_allclose(tree_logits, plain[np.arange(len(paths) - 1), last[:-1]], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(logits)[0, -1], plain[-1, last[-1]], rtol=1e-5, atol=1e-5)


def test_sampled_tree_acceptance_follows_the_target():
  """Random target distributions at every pass index, random candidate tokens: the first
  token (a depth-1 child kept, or the draw after none) and, given the first, the second
  follow the target's distributions at the root and at the kept child."""
  rows, vocab = 24000, 6
  tree = DraftTree(((0,), (1,), (2,), (0, 0), (0, 1)))
  rng = np.random.default_rng(3)
  logits = np.log(rng.dirichlet(np.ones(vocab), size=tree.nodes + 1)).astype(np.float32)
  tokens = np.array([0, 1, 2, 3, 4, 5], np.int32)  # the root's, then each node's (siblings differ)
  settings = {"temperature": np.ones(rows, np.float32), "top_k": np.zeros(rows, np.int32),
              "top_p": np.ones(rows, np.float32), "seed": np.arange(rows, dtype=np.uint32) + 10 ** 6}
  accepted, path, bonus = map(np.asarray, jax.jit(lambda l, t, s: verify_tree(
      tree, l, t, s, jnp.full(rows, 9), jnp.full(rows, tree.nodes)))(
      jnp.broadcast_to(logits, (rows, *logits.shape)), jnp.broadcast_to(tokens, (rows, len(tokens))), settings))
  generated = np.where(accepted[:, None] > np.arange(path.shape[1]), tokens[path], -1)
  first = np.where(accepted >= 1, generated[:, 0], bonus)
  p = np.exp(logits)
  counts = np.bincount(first, minlength=vocab)
  expected = p[0] * rows
  assert np.sum((counts - expected) ** 2 / expected) < CHI2_999[5]
  # Given node 1 (token 1) was kept, the next follows the target at pass index 1.
  after = accepted >= 1
  after &= path[:, 0] == 1
  second = np.where(accepted[after] >= 2, generated[after, 1], bonus[after])
  counts = np.bincount(second, minlength=vocab)
  expected = p[1] * after.sum()
  assert np.sum((counts - expected) ** 2 / expected) < CHI2_999[5]
  assert 0 < accepted.mean() < 2 and (accepted == 2).any()
