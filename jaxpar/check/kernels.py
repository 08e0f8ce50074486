"""Every kernel family at a few shapes: its door against its pure-jnp reference, and its time
against the device's peak. Shapes are small on CPU (the Pallas kernels run interpreted there)
and sized to fill the chip on a GPU or TPU."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import pallas_kernels as pk
from jaxpar.check.hardware import median_seconds
from jaxpar.check.results import Result, failed, relative_error
from jaxpar.mesh import AXES
from jaxpar.pallas_kernels.moe import grouped_ffn, grouped_ffn_reference


@dataclasses.dataclass(frozen=True)
class Setting:
  """How this run checks: dtype and tolerance for the backend, the depth (quick | default |
  full), and the rates a kernel's speed is set against ({"FLOP": (rate, source), "B": ...})."""
  platform: str
  mode: str
  peaks: dict
  repeats: int = 10

  @property
  def accelerated(self) -> bool:
    return self.platform in ("tpu", "gpu")

  @property
  def dtype(self):
    return jnp.bfloat16 if self.accelerated else jnp.float32

  @property
  def tolerance(self) -> float:
    # bf16 inputs against an f32 reference on the same inputs: the kernel's own bf16 roundings
    # (probabilities, outputs) land near 4e-3; f32 kernels land far under 1e-5.
    return 2e-2 if self.accelerated else 1e-4

  def pick(self, quick, default, full=None):
    return {"quick": quick, "default": default, "full": full or default}[self.mode]


def _random(key, shape, dtype, scale=1.0):
  return (scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


def _f32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def measure(setting, name, shape, kernel, reference, args, *, work, unit, tolerance=None, note="", mesh=None):
  """Run `kernel(*args)` (on `mesh`, if given) against `reference` on the f32 copy of the same
  inputs, then time it."""
  tolerance = tolerance or setting.tolerance
  try:
    want = jax.jit(reference)(*_f32(args))
    kernel = jax.jit(kernel)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      error = relative_error(kernel(*args), want)
      seconds = median_seconds(kernel, *args, repeats=setting.repeats)
  except Exception as e:  # a kernel that cannot run here is a FAIL row, not a crash of the check
    return failed(name, shape, e)
  peak, source = setting.peaks.get(unit, (None, ""))
  status = "PASS" if error <= tolerance else "FAIL"
  return Result(name, shape, status, error, tolerance, seconds, work, unit, peak, source, note)


def _attention_flops(batch, heads, q_len, kv_len, head_dim, causal=True):
  """q.k and p.v over the unmasked half (causal): 4 FLOPs per query, key and head dim."""
  return 4 * batch * heads * q_len * kv_len * head_dim * (0.5 if causal else 1.0)


def flash_attention(setting) -> list[Result]:
  shapes = setting.pick([(2, 2048, 16, 16, 128)],
                        [(4, 4096, 32, 8, 128), (4, 4096, 16, 16, 64)],
                        [(4, 4096, 32, 8, 128), (4, 4096, 16, 16, 64), (1, 16384, 32, 8, 128)])
  if not setting.accelerated:
    shapes = [(1, 256, 4, 2, 64)]
  where = "" if setting.accelerated else " (interpreted)"
  results = []
  for b, length, hq, hkv, d in shapes:
    q = _random(0, (b, length, hq, d), setting.dtype)
    k, v = (_random(i, (b, length, hkv, d), setting.dtype) for i in (1, 2))
    do = _random(3, (b, length, hq, d), setting.dtype)
    shape = f"B{b} L{length} H{hq}/{hkv} D{d}"
    flash = lambda q, k, v: pk.attention(q, k, v, pk.AttentionSpec(implementation="flash"))  # noqa: E731
    ref = lambda q, k, v: pk.attention_reference(q, k, v)  # noqa: E731  (causal by default)
    fwd = _attention_flops(b, hq, length, length, d)
    results.append(measure(setting, "flash attention fwd" + where, shape, flash, ref, (q, k, v),
                           work=fwd, unit="FLOP"))

    def grads(attend):
      loss = lambda q, k, v, do: jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))  # noqa: E731
      return jax.grad(loss, argnums=(0, 1, 2))

    # FlashAttention-2's count: the backward is 2.5 forwards (five matmuls to two).
    results.append(measure(setting, "flash attention fwd+bwd" + where, shape, grads(flash), grads(ref),
                           (q, k, v, do), work=3.5 * fwd, unit="FLOP"))
  return results


def _paged_inputs(setting, batch, heads, kv_heads, head_dim, max_len, page_size):
  pages_per_seq = -(-max_len // page_size)
  num_pages = batch * pages_per_seq
  rng = np.random.default_rng(0)
  page_table = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
  lengths = jnp.asarray(rng.integers(max_len // 2, max_len + 1, batch), jnp.int32)
  k, v = (_random(i, (kv_heads, num_pages, page_size, head_dim), setting.dtype) for i in (1, 2))
  q = _random(0, (batch, heads, head_dim), setting.dtype)
  live = int(np.sum(-(-np.asarray(lengths) // page_size))) * page_size
  read = 2 * live * kv_heads * head_dim * jnp.dtype(setting.dtype).itemsize
  return (q, k, v, lengths, page_table), read


def paged_decode(setting) -> list[Result]:
  shapes = setting.pick([(16, 32, 8, 128, 2048, 16)], [(32, 32, 8, 128, 4096, 16), (8, 32, 8, 128, 8192, 64)])
  if not setting.accelerated:
    shapes = [(4, 4, 2, 64, 200, 16)]
  kernels = [("flash", "paged decode attention")]
  if not setting.accelerated:  # what decode runs on CPU (C++), and the Pallas kernel interpreted
    kernels = [("auto", "paged decode attention (cpu)"), ("flash", "paged decode attention (interpreted)")]
  results = []
  for b, hq, hkv, d, max_len, page in shapes:
    args, read = _paged_inputs(setting, b, hq, hkv, d, max_len, page)
    shape = f"B{b} H{hq}/{hkv} D{d} len<={max_len} page{page}"
    ref = lambda q, k, v, n, t: pk.decode_attention_reference(q, k, v, n, page_table=t)  # noqa: E731
    for implementation, name in kernels:
      spec = pk.AttentionSpec(implementation=implementation)
      door = lambda q, k, v, n, t, s=spec: pk.decode_attention(q, k, v, n, s, page_table=t)  # noqa: E731
      results.append(measure(setting, name, shape, door, ref, args, work=read, unit="B",
                             note="bytes: the live pages' keys and values"))
  return results


def quantized_matmul(setting) -> list[Result]:
  shapes = setting.pick([(16, 4096, 4096)], [(16, 8192, 8192), (128, 8192, 8192)],
                        [(1, 8192, 8192), (16, 8192, 8192), (128, 8192, 8192), (512, 8192, 8192)])
  if not setting.accelerated:
    shapes = [(8, 256, 256)]
  where = "" if setting.accelerated else " (interpreted)"
  results = []
  for m, k, n in shapes:
    x = _random(0, (m, k), setting.dtype)
    w = _random(1, (k, n), jnp.float32, scale=k ** -0.5)
    dense = w.astype(setting.dtype)
    dense_s = median_seconds(jax.jit(lambda x, w: x @ w), x, dense, repeats=setting.repeats)
    for mode, group in (("int8", None), ("int4", 128), ("w8a8", None)):
      qw = pk.quantize_weight(w, mode, group)
      read = qw.nbytes + x.nbytes + m * n * x.dtype.itemsize
      door = lambda x, qw: pk.quantized_matmul(x, qw, implementation="pallas")  # noqa: E731
      ref = lambda x, qw: pk.quantized_matmul(x, qw, implementation="xla")  # noqa: E731
      result = measure(setting, f"quantized matmul {mode}{where}", f"M{m} K{k} N{n}", door, ref,
                       (x, qw), work=read, unit="B")
      if result.seconds:
        result.note = f"{dense_s / result.seconds:.2f}x the {jnp.dtype(setting.dtype).name} dot ({dense_s * 1e3:.3f} ms)"
      results.append(result)
  return results


def grouped_moe(setting) -> list[Result]:
  shapes = setting.pick([(8192, 8, 1024, 1024)], [(16384, 8, 2048, 1408)], [(16384, 8, 2048, 1408), (65536, 64, 2048, 768)])
  if not setting.accelerated:
    shapes = [(512, 4, 64, 128)]
  results = []
  for rows, experts, d, f in shapes:
    x = _random(0, (rows, d), setting.dtype)
    groups = jax.random.randint(jax.random.key(1), (rows,), 0, experts)
    gate, up = (_random(i, (experts, d, f), setting.dtype, d ** -0.5) for i in (2, 3))
    down = _random(4, (experts, f, d), setting.dtype, f ** -0.5)
    door = lambda *a: grouped_ffn(*a, implementation="blocked")  # noqa: E731
    results.append(measure(setting, "grouped MoE SwiGLU", f"R{rows} E{experts} D{d} F{f}", door,
                           grouped_ffn_reference, (x, groups, gate, up, down), work=6 * rows * d * f,
                           unit="FLOP"))
  return results


def _delta_rule_inputs(setting, b, length, key_heads, heads, d):
  """q, k, v, g, beta as the Gated DeltaNet block gives them: unit q and k, decays in (0, 1),
  beta in (0, 1)."""
  unit = lambda x: (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(setting.dtype)  # noqa: E731
  q, k = (unit(_random(i, (b, length, key_heads, d), jnp.float32)) for i in (0, 1))
  v = _random(2, (b, length, heads, d), setting.dtype)
  g = -0.5 * jax.nn.softplus(_random(3, (b, length, heads), jnp.float32))
  return q, k, v, g, jax.nn.sigmoid(_random(4, (b, length, heads), jnp.float32))


def gated_delta_rule(setting) -> list[Result]:
  """The chunked Gated DeltaNet kernel against the token-by-token recurrence. Work: the chunked
  form's matmuls per chunk of 64 (q.k and k.k, the solve's right-hand sides, the state's read,
  correction and update), the triangular solve left out; the backward about twice the forward."""
  shapes = setting.pick([(1, 2048, 8, 16, 128)], [(2, 4096, 16, 32, 128)], [(2, 4096, 16, 32, 128), (1, 16384, 16, 32, 128)])
  if not setting.accelerated:
    shapes = [(1, 64, 2, 4, 32)]
  where = "" if setting.accelerated else " (interpreted)"
  results = []
  for b, length, key_heads, heads, d in shapes:
    inputs = _delta_rule_inputs(setting, b, length, key_heads, heads, d)
    chunk = min(64, length)
    fwd = 2 * b * length * heads * (2 * chunk * d + 2 * chunk * 2 * d + chunk * d + 3 * d * d)
    shape = f"B{b} L{length} H{heads}/{key_heads} D{d}"
    kernel = lambda *a: pk.gated_delta_rule(*a, implementation="pallas")[0]  # noqa: E731
    ref = lambda *a: pk.gated_delta_rule_reference(*a)[0]  # noqa: E731
    results.append(measure(setting, "gated delta rule fwd" + where, shape, kernel, ref, inputs, work=fwd,
                           unit="FLOP"))
    cotangent = _random(5, inputs[2].shape, setting.dtype)

    def grads(rule):
      loss = lambda *a: jnp.sum(rule(*a[:5]).astype(jnp.float32) * a[5].astype(jnp.float32))  # noqa: E731
      return jax.grad(loss, argnums=tuple(range(5)))

    results.append(measure(setting, "gated delta rule fwd+bwd" + where, shape, grads(kernel), grads(ref),
                           (*inputs, cotangent), work=3 * fwd, unit="FLOP"))
  return results


def ring_attention(setting) -> list[Result]:
  devices = jax.local_devices()
  n = len(devices)
  shape_text = f"context={n}"
  if n < 2:
    return [Result("ring attention", shape_text, status="SKIP", note="one local device")]
  length, heads, d = (n * 1024, 16, 128) if setting.accelerated else (n * 64, 2, 32)
  mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 1, 1, n, 1, 1), AXES,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))
  q, k, v = (_random(i, (1, length, heads, d), setting.dtype) for i in range(3))

  ring = lambda q, k, v: pk.attention(q, k, v, context_parallel="ring")  # noqa: E731
  ref = lambda q, k, v: pk.attention_reference(q, k, v)  # noqa: E731
  return [measure(setting, "ring attention", f"L{length} H{heads} D{d} {shape_text}", ring, ref, (q, k, v),
                  work=_attention_flops(1, heads, length, length, d), unit="FLOP", mesh=mesh)]


FAMILIES = {"flash attention": flash_attention, "paged decode": paged_decode,
            "quantized matmul": quantized_matmul, "grouped moe": grouped_moe, "gated delta rule": gated_delta_rule,
            "ring attention": ring_attention}


def check_kernels(setting, families=None) -> list[Result]:
  results = []
  for name, family in FAMILIES.items():
    if families is None or name in families:
      try:
        results += family(setting)
      except Exception as e:  # inputs that could not be built still name the family
        results.append(failed(name, "-", e))
  return results


