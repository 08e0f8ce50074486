"""A whole train step and a whole decode step of a small model, on every local device:
the train step's model FLOPs utilisation and the decode step's weight-streaming bandwidth."""

import time

import jax
import numpy as np

from jaxpar.check.hardware import median_seconds
from jaxpar.check.results import Result, failed
from jaxpar.config import load_config
from jaxpar.data import ByteTokenizer
from jaxpar.data.loader import KEYS as BATCH_KEYS
from jaxpar.inference import Engine, SamplingParams
from jaxpar.models.low_precision import native
from jaxpar.runtime import Runtime
from jaxpar.train.flops import train_flops_per_token
from jaxpar.train.trainer import Trainer

# A GPT-2-small-sized Llama on accelerators (~120M parameters with a 32k vocabulary); the
# embedded default's shape on CPU.
_ACCELERATOR_MODEL = ["model.embed_dim=768", "model.num_layers=12", "model.num_heads=12", "model.num_kv_heads=12",
                      "model.head_dim=64", "model.mlp_dim=3072", "model.max_seq_len=1024",
                      "model.compute_dtype=bfloat16", "data.seq_len=1024"]


def _config(setting, batch_per_device: int, extra=()):
  devices = len(jax.local_devices())
  model = _ACCELERATOR_MODEL if setting.accelerated else ["data.seq_len=128"]
  overrides = [*model, f"data.global_batch_size={batch_per_device * devices}", "mesh.fsdp=-1",
               "checkpoint.enabled=false", "train.run_dir=runs/jaxpar-check", *extra]
  return load_config("bench-20m" if setting.accelerated else "tiny", overrides)


def _random_batch(config, sharding):
  b, length = config.data.global_batch_size, config.data.seq_len
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (b, length + 1))
  local = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, length)),
           "positions": np.broadcast_to(np.arange(length), (b, length)), "loss_mask": np.ones((b, length))}
  dtypes = {k: np.float32 if k == "loss_mask" else np.int32 for k in BATCH_KEYS}
  return {k: jax.device_put(local[k].astype(dtypes[k]), sharding) for k in BATCH_KEYS}


def train_step(setting, precision="compute_dtype") -> Result:
  per_device = setting.pick(8, 8) if setting.accelerated else 4
  config = _config(setting, per_device, [f"model.train_precision={precision}"])
  name = "train step (MFU)" if precision == "compute_dtype" else f"train step, {precision} matmuls (MFU)"
  shape = f"{config.model.num_layers} layers x {config.model.embed_dim}, batch {config.data.global_batch_size} x {config.data.seq_len}"
  try:
    trainer = Trainer(config)
    batch = _random_batch(config, trainer.batch_sharding)
    state = trainer.init_state()
    losses = []
    for _ in range(2):  # compile, then one run
      state, metrics = trainer.step(state, batch)
      losses.append(float(metrics["loss"]))
    steps = setting.repeats
    start = time.perf_counter()
    for _ in range(steps):
      state, metrics = trainer.step(state, batch)
    final = float(metrics["loss"])  # waits for the last step
    seconds = (time.perf_counter() - start) / steps
  except Exception as e:
    return failed(name, shape, e)
  tokens = config.data.global_batch_size * config.data.seq_len
  flops = train_flops_per_token(config.model, config.data.seq_len) * tokens
  peak, source = setting.peaks.get("FLOP", (None, ""))
  # Steps on one repeated batch must lower its loss: a step that trains nothing fails here.
  learned = np.isfinite(final) and final < losses[0]
  note = f"loss {losses[0]:.3f} -> {final:.3f} on one batch; {tokens / seconds:,.0f} tokens/s; {trainer.num_params / 1e6:.0f}M params"
  return Result(name, shape, "PASS" if learned else "FAIL", seconds=seconds, work=flops,
                unit="FLOP", peak=peak and peak * len(jax.local_devices()), peak_source=source, note=note)


def decode_step(setting) -> Result:
  batch, prompt, new = (32, 64, 64) if setting.accelerated else (8, 32, 16)
  config = _config(setting, 1)
  shape = f"batch {batch}, prompt {prompt}, {new} new tokens"
  try:
    runtime = Runtime(config.model, config.mesh.model_copy(update={"fsdp": 1}), jax.local_devices()[:1])
    params, model_state = runtime.init()
    engine = Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=batch,
                    max_seq_len=prompt + new + 8, prefill_chunks=(prompt,))
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, prompt)] for _ in range(batch)]

    def run(n):
      return engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=()))

    # The difference of a long and a short generation leaves only decode steps in the time.
    short, long = (median_seconds(lambda n=n: run(n), repeats=3) for n in (new // 4, new))
    seconds = (long - short) / (new - new // 4)
    # Greedy decoding is deterministic: the same prompts give the same tokens twice.
    same = [c.tokens for c in run(new)] == [c.tokens for c in run(new)]
  except Exception as e:
    return failed("decode step", shape, e)
  weights = sum(x.nbytes for x in jax.tree.leaves(params))
  peak, source = setting.peaks.get("B", (None, ""))
  note = f"{batch / seconds:,.0f} tokens/s; bytes: the weights once per step"
  return Result("decode step", shape, "PASS" if same else "FAIL", seconds=seconds, work=weights, unit="B",
                peak=peak, peak_source=source, note=note if same else "greedy tokens differ between two runs")


def check_steps(setting) -> list[Result]:
  """The train step, again with each model.train_precision this device multiplies natively
  (fp8 on NVIDIA Ada/Hopper and later, int8 on NVIDIA and TPU v5/v6), and the decode step."""
  plain = train_step(setting)
  narrow = [train_step(setting, p) for p in ("fp8", "fp8_delayed", "int8") if native(p, jax.local_devices()[0])]
  for result in narrow:
    if result.seconds and plain.seconds:
      result.note += f"; {plain.seconds / result.seconds:.2f}x the plain step's speed"
  return [plain, *narrow, decode_step(setting)]


