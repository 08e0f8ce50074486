"""The planner's analytic model: per-device memory and step time of a candidate layout,
from the config alone (no tracing), to prune before anything is compiled.

Per device, with P params, L layers, t = tensor, f = fsdp x expert x context x stage (the
devices FSDP presets split parameters over; a pipeline splits the layers over `stage` and the
rest as FSDP), d = data, x = context, e = expert, m = microbatches, T = tokens per device per
microbatch, c = compute-dtype bytes, p = param-dtype bytes; with a pipeline of S stages, R
repeats and M pipeline microbatches, I = M R + S - 1 iterations, b = (S - 1) / I its bubble:

  state      = P x p x 3 / (f t)              params + Adam m, v (split over fsdp x tensor)
  grads      = P x p / (f t)                  accumulated gradients
  gathered   = 2 x P/L x c / t (if f > 1)     one layer's weights all-gathered, double-buffered
  saved      = L/S x T x c x k_remat          residuals kept for the backward pass:
               full: E; save_dots: (H+2K)D/t + 2F/t + 2E; none: twice save_dots;
               per-name policies: the names saved in HBM (offloaded ones live on the host)
  working    = T x c x (4E + 3F/t + 2(H+2K)D/t) + 2 T x V/t x c   one layer; logits and their
               gradient (too much when the loss is fused and chunked: kept as a margin)

  Against the compiler (full depth, remat=full): llama3-8b on v6e-256 22.4 GiB predicted vs
  15.4 compiled; llama2-70b on v5p-512 33.4 vs 39.9. Rough (+-40%): it only prunes; the
  compile of the survivors decides.

  compute    = model FLOPs x remat factor / (devices x peak) / (1 - b); the factor is 4/3
               when the forward runs again in the backward pass (full, per-name policies),
               else 1; the bubble's share of the iterations idles. Under an int8
               train_precision the projections' FLOPs (6 x matmul params less the output
               head) run at the chip's int8 peak, attention and the head at bf16's
  comm bytes = FSDP: 3 m x P c/t x (f-1)/f (gather fwd + bwd, reduce-scatter grads)
             + DP:   2 x P p/(f t) x (d-1)/d (all-reduce of grads)
             + TP:   (4 or 6 with full remat) x L x m x 2 T E c x (t-1)/t (activation all-reduces)
             + CP:   2 x L x m x 2 x T K D c/t x (x-1) (keys and values gathered forward,
                     their gradients reduce-scattered backward)
             + EP:   4 x L_moe x m x T k E c x (e-1)/e (tokens to and from their experts'
                     devices, forward and backward; k experts per token)
             + PP:   2 x m x I x T/M E c (stage hand-offs, forward and backward); a stage's
                     FSDP gathers repeat every iteration (I/M per microbatch, of P/S)
  DCN bytes  = across slices, the part of the above on the axis that spans them: stage
               (the hand-offs), data (the gradient all-reduce) or fsdp (every gather and
               reduce-scatter, k - 1 shards each)
  TPU step   = compute + comm / ICI bandwidth + DCN bytes / DCN bandwidth + 2 state / HBM bandwidth
  CPU step   = compute / host peak + devices x (comm + 2 state) / copy bandwidth: simulated
               devices share the host's cores and memory, so nothing overlaps.
"""

from dataclasses import dataclass

from jaxpar.models.flops import causal_attention_flops
from jaxpar.train.flops import train_flops_per_token

_BYTES = {"float32": 4, "bfloat16": 2}
REMAT_FACTOR = {"none": 1.0, "save_dots": 1.0, "save_dots_no_batch": 1.0, "full": 4 / 3}


def remat_factor(remat) -> float:
  return REMAT_FACTOR[remat] if isinstance(remat, str) else 4 / 3


def saved_per_token(m, remat, t: int) -> float:
  """Elements per token and layer kept in HBM for the backward pass."""
  qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim / t
  if not isinstance(remat, str):
    sizes = {"decoder_layer_input": m.embed_dim, "qkv_proj": qkv,
             "attention_out": m.num_heads * m.head_dim / t, "out_proj": m.embed_dim,
             "mlp_in": 2 * m.mlp_dim / t, "mlp_out": m.embed_dim}
    return sum(sizes[n] for n, action in remat.items() if action == "save")
  save_dots = qkv + 2 * m.mlp_dim / t + 2 * m.embed_dim
  return {"full": m.embed_dim, "save_dots": save_dots, "save_dots_no_batch": save_dots,
          "none": 2 * save_dots}[remat]


@dataclass(frozen=True)
class Hardware:
  """What the model needs of a target: a TPU chip, or this host's simulated devices."""
  name: str
  hbm_bytes: float | None  # None: no limit to prune on
  peak_flops: float  # per device (TPU) or per host (CPU)
  hbm_bandwidth: float
  link_bandwidth: float
  shared_host: bool  # CPU: devices share the cores; nothing overlaps
  dcn_bandwidth: float | None = None  # per device across slices (multi-slice TPU)
  int8_flops: float | None = None  # per device; None: int8 matmuls at the bf16 peak


@dataclass(frozen=True)
class Layout:
  data: int
  fsdp: int
  tensor: int
  remat: str | dict
  microbatches: int
  context: int = 1
  expert: int = 1
  stage: int = 1
  pipeline_microbatches: int = 1  # M, per train microbatch (1 without a pipeline)
  repeats: int = 1  # R: circular when > 1
  num_slices: int = 1
  dcn_axis: str = "data"  # the axis spanning the slices (with num_slices > 1)
  optimizer_state: str | None = None  # train.optimizer_state_dtype to set (None: the config's)
  train_precision: str | None = None  # model.train_precision to set (None: the config's)

  @property
  def devices(self) -> int:
    return self.data * self.stage * self.fsdp * self.context * self.expert * self.tensor

  @property
  def iterations(self) -> int:
    """Pipeline iterations per train microbatch (M R + S - 1; 1 without a pipeline)."""
    return self.pipeline_microbatches * self.repeats + self.stage - 1 if self.stage > 1 else 1

  @property
  def bubble(self) -> float:
    return (self.stage - 1) / self.iterations

  @property
  def batch_shards(self) -> int:
    return self.data * self.fsdp * self.expert

  @property
  def state_shards(self) -> int:
    """Devices the FSDP presets split each parameter's `embed` over (a pipeline's layers
    over `stage`, the rest as FSDP over it)."""
    return self.fsdp * self.expert * self.context * self.stage

  def overrides(self) -> dict:
    """The config sections this layout sets (the rules stay the config's)."""
    schedule = "circular" if self.repeats > 1 else "gpipe"
    pipeline = ({"schedule": schedule, "repeats": self.repeats, "microbatches": self.pipeline_microbatches}
                if self.stage > 1 else {"schedule": "gpipe", "repeats": 1, "microbatches": None})
    return {"mesh": {"data": self.data, "stage": self.stage, "fsdp": self.fsdp, "context": self.context,
                     "expert": self.expert, "tensor": self.tensor, "num_slices": self.num_slices,
                     "dcn_axis": self.dcn_axis},
            "parallel": {"pipeline": pipeline},
            "model": {"remat": self.remat,
                      **({"train_precision": self.train_precision} if self.train_precision else {})},
            "train": {"microbatches": self.microbatches,
                      **({"optimizer_state_dtype": self.optimizer_state} if self.optimizer_state else {})}}

  def __str__(self):
    extra = "".join(f" {a}={getattr(self, a)}" for a in ("context", "expert") if getattr(self, a) > 1)
    stage = ""
    if self.stage > 1:
      stage = f"stage={self.stage} (M={self.pipeline_microbatches}" + \
          (f" R={self.repeats}" if self.repeats > 1 else "") + ") "
    slices = f" {self.dcn_axis} over {self.num_slices} slices" if self.num_slices > 1 else ""
    moments = f" moments={self.optimizer_state}" if self.optimizer_state else ""
    moments += f" precision={self.train_precision}" if self.train_precision else ""
    return (f"data={self.data} {stage}fsdp={self.fsdp}{extra} tensor={self.tensor} remat={self.remat} "
            f"microbatches={self.microbatches}{slices}{moments}")


INT8_PRECISIONS = ("int8", "int8_stochastic")


def int8_flops_per_token(m, precision: str, seq_len: int) -> float:
  """Training FLOPs per token in int8 matmuls: the projections' (6 x matmul params less the
  output head, which stays float) under an int8 train_precision, else none."""
  if precision not in INT8_PRECISIONS:
    return 0.0
  projections = train_flops_per_token(m, seq_len) - causal_attention_flops(m, seq_len)
  return max(projections - 6 * m.embed_dim * m.vocab_size, 0.0)


def tokens_per_device(config, layout: Layout) -> int:
  """Tokens one device holds in one microbatch."""
  d = config.data
  return d.global_batch_size // layout.microbatches // layout.batch_shards * d.seq_len // layout.context


# Bytes per parameter of the two AdamW moments stored narrower (train.optimizer_state_dtype;
# float32, the default, keeps them as optax does: in the parameters' dtype).
MOMENT_BYTES = {"bfloat16": 4.0, "int8_blockwise": 2 * (1 + 4 / 128)}


def memory_bytes(config, layout: Layout, num_params: int) -> float:
  m = config.model
  t, f = layout.tensor, layout.state_shards
  p, c = _BYTES[m.param_dtype], _BYTES[m.compute_dtype]
  tokens = tokens_per_device(config, layout)
  qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim / t
  moments = MOMENT_BYTES.get(layout.optimizer_state or config.train.optimizer_state_dtype, 2 * p)
  state = num_params * (p + moments) / (f * t)
  grads = num_params * p / (f * t)
  gathered = 2 * num_params / m.num_layers * c / t if f > 1 else 0.0
  saved = m.num_layers / layout.stage * tokens * c * saved_per_token(m, layout.remat, t)
  working = (tokens * c * (4 * m.embed_dim + 3 * m.mlp_dim / t + 2 * qkv)
             + 2 * tokens * m.vocab_size / t * c)
  return state + grads + gathered + saved + working


def step_seconds(config, layout: Layout, num_params: int, hw: Hardware) -> float:
  m, d = config.model, config.data
  t, f, dp, mb = layout.tensor, layout.state_shards, layout.data, layout.microbatches
  x, e = layout.context, layout.expert
  devices = layout.devices
  p, c = _BYTES[m.param_dtype], _BYTES[m.compute_dtype]
  tokens_per_step = d.global_batch_size * d.seq_len
  flops = train_flops_per_token(m, d.seq_len) * tokens_per_step
  int8 = int8_flops_per_token(m, layout.train_precision or m.train_precision, d.seq_len) * tokens_per_step \
      if hw.int8_flops else 0.0
  if int8:  # in bf16-peak FLOPs: the int8 share costs peak / int8 peak of its count
    flops -= int8 * (1 - hw.peak_flops / hw.int8_flops)
  flops *= remat_factor(layout.remat) / (1 - layout.bubble)
  tokens = tokens_per_device(config, layout)
  S, M, fsdp = layout.stage, layout.pipeline_microbatches, f // layout.stage
  # A stage gathers its P/S weights every iteration; unpipelined, every microbatch.
  gathers = mb * layout.iterations / M if S > 1 else mb
  fsdp_comm = 3 * gathers * num_params / S * c / t * (fsdp - 1) / fsdp
  data_comm = 2 * num_params * p / (f * t) * (dp - 1) / dp
  hand_offs = 2 * mb * layout.iterations * tokens / M * m.embed_dim * c if S > 1 else 0.0
  comm = fsdp_comm + data_comm + hand_offs
  comm += (6 if layout.remat == "full" else 4) * m.num_layers * mb * 2 * tokens * m.embed_dim * c \
      * (t - 1) / t
  comm += 2 * m.num_layers * mb * 2 * tokens * m.num_kv_heads * m.head_dim * c / t * (x - 1)
  moe = getattr(m, "moe", None)
  if moe is not None and m.mlp == "moe":
    moe_layers = m.num_layers - m.first_dense_layers
    comm += 4 * moe_layers * mb * tokens * moe.experts_per_token * m.embed_dim * c * (e - 1) / e
  state = num_params * p * 3 / (f * t)
  if hw.shared_host:
    return flops / hw.peak_flops + devices * (comm + 2 * state) / hw.link_bandwidth
  dcn = 0.0
  if layout.num_slices > 1:
    k = layout.num_slices
    dcn = {"stage": hand_offs, "data": data_comm * (k - 1) / (dp - 1) if dp > 1 else 0.0,
           "fsdp": fsdp_comm * (k - 1) / (fsdp - 1) if fsdp > 1 else 0.0}[layout.dcn_axis]
  return (flops / (devices * hw.peak_flops) + (comm - dcn) / hw.link_bandwidth
          + dcn / (hw.dcn_bandwidth or hw.link_bandwidth) + 2 * state / hw.hbm_bandwidth)
