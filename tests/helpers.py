"""Small configs and synthetic batches shared by the tests."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from jaxpar.config import from_dict

SMALL_MODEL = dict(vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, mlp_dim=128, max_seq_len=128)


def small_config(mesh=None, model=None, data=None, train=None, tmp_path=None, checkpoint=None,
                 parallel=None, objective=None):
  tree = {
    "model": {**SMALL_MODEL, **(model or {})},
    "mesh": {"fsdp": -1, "rules": "fsdp_tp", **(mesh or {})},
    "parallel": parallel or {},
    "data": {"seq_len": 32, "global_batch_size": 8, **(data or {})},
    "train": {"steps": 3, "warmup_steps": 1, "log_every": 0,
              # Without a tmp_path, still one run dir per test process: a run dir belongs to
              # one job at a time, and parallel test workers are separate jobs.
              "run_dir": str(tmp_path / "run") if tmp_path else
              os.path.join(tempfile.gettempdir(), f"jaxpar-test-{os.getpid()}"), **(train or {})},
    # Only a test's own tmp run dir gets checkpoints: never resume another test's run.
    "checkpoint": {"enabled": tmp_path is not None, **(checkpoint or {})},
    "objective": objective or {},
  }
  return from_dict(tree)


def synthetic_batch(config, seed=0, documents_per_row=2):
  """A packed batch (numpy) with a document boundary inside every row."""
  rng = np.random.default_rng(seed)
  b, l = config.data.global_batch_size, config.data.seq_len
  inputs = rng.integers(0, 258, (b, l), dtype=np.int32)
  targets = rng.integers(0, 258, (b, l), dtype=np.int32)
  cut = l // documents_per_row
  segment_ids = np.where(np.arange(l) < cut, 1, 2).astype(np.int32)[None].repeat(b, 0)
  positions = np.where(np.arange(l) < cut, np.arange(l), np.arange(l) - cut).astype(np.int32)[None].repeat(b, 0)
  loss_mask = np.ones((b, l), np.float32)
  loss_mask[:, cut - 1] = 0.0
  return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids,
          "positions": positions, "loss_mask": loss_mask}


def gradient_temp_bytes(config, num_devices: int) -> int:
  """Temporaries per device of `config`'s compiled gradient step (fused loss, 128-position
  chunks) on the first `num_devices` devices: what activation memory a change saves."""
  import jax

  from jaxpar.objectives.lm import lm_loss
  from jaxpar.train.step import make_gradients
  from jaxpar.train.trainer import Trainer
  trainer = Trainer(config, devices=jax.devices()[:num_devices])
  params = trainer.abstract_state().params
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
           for k, v in synthetic_batch(config).items()}
  with trainer.context():
    gradients = make_gradients(lm_loss(trainer.graphdef, z_loss=0.0, logits_chunk_len=128), microbatches=1)
    compiled = jax.jit(gradients).lower(params, batch).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def tensorboard_scalars(run_dir) -> dict[str, dict[int, float]]:
  """What TensorBoard itself reads from a run's events: {tag: {step: value}}."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
  events.Reload()
  return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


class counting_compiles:
  """`with counting_compiles() as compiles:` -> the programs compiled inside: every backend
  compile, and every compile served from the persistent compilation cache (a retrace that
  the cache hides is still a recompile). The listeners are removed on exit."""

  _COMPILED = "/jax/core/compile/backend_compile_duration"
  _CACHE_HIT = "/jax/compilation_cache/cache_hits"

  def __enter__(self) -> list:
    import jax
    self.events = []
    self._duration = lambda name, *_, **__: self.events.append(name) if name == self._COMPILED else None
    self._event = lambda name, *_, **__: self.events.append(name) if name == self._CACHE_HIT else None
    jax.monitoring.register_event_duration_secs_listener(self._duration)
    jax.monitoring.register_event_listener(self._event)
    return self.events

  def __exit__(self, *exc):
    import jax
    jax.monitoring.unregister_event_duration_listener(self._duration)
    jax.monitoring.unregister_event_listener(self._event)


def swiglu_mlp(m, h):
  """The dense SwiGLU block in float64 numpy: m holds one layer's gate, up and down."""
  gate = h @ m["gate"]
  return (gate / (1 + np.exp(-gate)) * (h @ m["up"])) @ m["down"]


def reference_decoder_logits(p, tokens, eps=1e-5, theta=10000.0, mlps=None):
  """The decoder written out in float64 numpy, from the parameters: pre-norm layers of GQA
  attention (q/k/v biases and q/k RMSNorm where present, RoPE on the two halves, causal
  softmax) and a feed-forward block per group (`mlps`: {group: (params, h) -> out}, SwiGLU
  by default), the groups in stack order; tied output projection unless `unembed` exists."""
  rms = lambda x, scale: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale  # noqa: E731
  x = p["embed"][tokens]
  length = tokens.shape[1]
  for group in ("dense_layers", "layers"):
    layers = p.get(group)
    for i in range(0 if layers is None else layers["attn"]["q"].shape[0]):
      a = {k: (v[i] if not isinstance(v, dict) else v["scale"][i]) for k, v in layers["attn"].items()}
      h = rms(x, layers["attn_norm"]["scale"][i])
      q, k, v = (np.einsum("ble,ehd->blhd", h, a[n]) + a.get(f"{n}_bias", 0.0) for n in ("q", "k", "v"))
      if "q_norm" in a:
        q, k = rms(q, a["q_norm"]), rms(k, a["k_norm"])
      d = q.shape[-1]
      angles = np.arange(length)[:, None] / theta ** (np.arange(0, d, 2) / d)
      cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
      rope = lambda t: np.concatenate([t[..., :d // 2] * cos - t[..., d // 2:] * sin,  # noqa: E731
                                       t[..., d // 2:] * cos + t[..., :d // 2] * sin], -1)
      q, k = rope(q), rope(k)
      k, v = (np.repeat(t, q.shape[2] // t.shape[2], axis=2) for t in (k, v))
      scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
      scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
      probs = np.exp(scores - scores.max(-1, keepdims=True))
      probs /= probs.sum(-1, keepdims=True)
      x = x + np.einsum("bhqk,bkhd,hde->bqe", probs, v, a["o"])
      mlp = (mlps or {}).get(group, swiglu_mlp)
      x = x + mlp({k: v[i] for k, v in layers["mlp"].items()}, rms(x, layers["mlp_norm"]["scale"][i]))
  out = rms(x, p["final_norm"]["scale"])
  return out @ p["unembed"] if "unembed" in p else out @ p["embed"].T


ROOT = Path(__file__).parent.parent
JOB_WAIT_S = 300  # bound on any wait for a Job's process


class Job:
  """A `python -m jaxpar ...` process whose output lines the test can wait for."""

  def __init__(self, *args, env=None, wrapper=()):
    """`wrapper`: a command that runs jaxpar, e.g. ("timeout", "600"). The job has a session
    of its own, so a signal to its process group reaches nothing else."""
    self.process = subprocess.Popen([*wrapper, sys.executable, "-m", "jaxpar", *args], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
    self.lines: list[str] = []
    self._changed = threading.Condition()
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.process.stdout:
      with self._changed:
        self.lines.append(line.rstrip("\n"))
        self._changed.notify_all()
    with self._changed:
      self.lines.append(None)  # end of output
      self._changed.notify_all()

  @property
  def text(self) -> str:
    return "\n".join(line for line in self.lines if line is not None)

  def wait_for(self, pattern: str, timeout: float = JOB_WAIT_S) -> re.Match:
    deadline = time.monotonic() + timeout
    with self._changed:
      while True:
        found = [m for line in self.lines if line is not None for m in [re.search(pattern, line)] if m]
        if found:
          return found[0]
        remaining = deadline - time.monotonic()
        assert None not in self.lines and remaining > 0, f"no {pattern!r} in:\n{self.text[-4000:]}"
        self._changed.wait(remaining)

  def pids(self) -> list[int]:
    return [int(p) for p in self.wait_for(r"^launch-local: .* pids ([\d ]+)$").group(1).split()]

  def finish(self, timeout: float = JOB_WAIT_S) -> int:
    code = self.process.wait(timeout)
    self._reader.join(timeout)
    return code

  def kill_all(self):
    """Cleanup after a failed test: the launched processes run in their own sessions."""
    pids = [int(p) for m in [re.search(r"pids ([\d ]+)$", self.text, re.M)] if m for p in m.group(1).split()]
    for pid in pids + [self.process.pid]:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass


def gradients_on_8_devices_and_one(model, mesh, logits_chunk_len=16):
  """The LM loss's gradients and sums of one 8-sequence batch from the same initial
  parameters: ((gradients, sums) on one device with plain logits, the same on `mesh` (a
  MeshConfig over 8 devices) with the fused loss over chunks of `logits_chunk_len`)."""
  import jax
  from jaxpar.config import MeshConfig
  from jaxpar.objectives.lm import lm_loss
  from jaxpar.runtime import Runtime
  from jaxpar.train.step import make_gradients
  batch = synthetic_batch(small_config(data={"global_batch_size": 8}))
  wide, one = Runtime(model, mesh), Runtime(model, MeshConfig(fsdp=1), jax.devices()[:1])
  params, _ = wide.init()

  def gradients(runtime, chunk):
    step = jax.jit(make_gradients(lm_loss(runtime.graphdef, z_loss=1e-4, logits_chunk_len=chunk), microbatches=1))
    with runtime.context():
      return jax.device_get(step(jax.device_put(jax.device_get(params), runtime.param_shardings), batch)[:2])
  return gradients(one, 0), gradients(wide, logits_chunk_len)
