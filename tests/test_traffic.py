"""Under FSDP the compiled train step moves the least data its layout allows (8 simulated
CPU devices): weights gathered once forward and once backward, every weight gradient
reduce-scattered into its owner's shard (inside the layer loop and outside it), never
all-reduced whole, and the bytes on the wire within 5% of the hand-computed minimum.

The CPU backend promotes bf16 collectives to f32 (XLA's AllReducePromotion and
FloatNormalization), so these models compute in f32; that the gathers are bf16 on a TPU
is checked by the libtpu compile in test_compile.py.
"""

import pytest

from jaxpar.aot import hlo, traffic
from jaxpar.aot.compile import compile_step
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config

MODEL = dict(vocab_size=1024, embed_dim=256, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=64, mlp_dim=512, max_seq_len=128, remat="full")
SMALLEST_WEIGHT = 4 * 256 * 2 * 64  # bytes of k (f32): any weight gradient all-reduced is bigger


@pytest.mark.parametrize("microbatches", [1, 2])
def test_fsdp8_reduce_scatters_gradients_and_moves_the_minimum(microbatches):
  config = small_config(model=MODEL, mesh={"fsdp": 8},
                        data={"seq_len": 128, "global_batch_size": 8 * microbatches},
                        train={"logits_chunk_len": 32, "microbatches": microbatches})
  trainer = Trainer(config)
  compiled, _ = compile_step(trainer)
  found = hlo.collectives(compiled.as_text(), [0] * 8, cpu=True)
  layers = config.model.num_layers
  scatters = [c for c in found if c.kind == "reduce-scatter"]
  # Per layer inside the scanned layer loop (count = trips), and once after the loss's
  # chunk loop for the output projection (count = microbatches).
  assert any(c.count == layers * microbatches for c in scatters), found
  assert any(c.count == microbatches and c.bytes >= 4 * 256 * 1024 * microbatches
             for c in scatters), found
  all_reduced = sum(c.bytes / c.count for c in found if c.kind == "all-reduce")
  assert all_reduced < SMALLEST_WEIGHT, found  # norm scales and scalars only
  measured = sum(c.wire_bytes for c in found)
  minimum = traffic.minimum_wire_bytes(config, trainer.mesh, trainer.rules)["total"]
  assert measured == pytest.approx(minimum, rel=0.05)
