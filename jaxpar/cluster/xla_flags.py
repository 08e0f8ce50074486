"""XLA / libtpu compiler options per chip generation (`mesh.xla_flags`), passed to the
train step's `jax.jit` by `jaxpar train` and `jaxpar compile` alike.

  default  the preset for the devices' TPU generation (none on CPU and GPU)
  none     no options: the compiler's own defaults
  [...]    exactly these, as `xla_flag=value` strings (a leading `--` is optional)

The presets are the flags the published MaxText recipes for these chips set (the scoped
VMEM limit for dense models, continuation fusion of FSDP all-gathers with the matmuls that
consume them, reduce-scatter friendly layouts, data-parallel all-reduce overlap, and the
scheduler options recommended with host offload), plus SparseCore reduce-scatters on v6e
and v5p (see below). Each flag is first tried on a tiny program for the same devices; one
the installed libtpu rejects for that chip is left out with a note (the run goes on
without it).
"""

import functools
import logging

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

_GATHER_OVERLAP = ("xla_tpu_enable_async_collective_fusion=true",
                   "xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
                   "xla_tpu_enable_async_collective_fusion_multiple_steps=true",
                   "xla_tpu_overlap_compute_collective_tc=true",
                   "xla_enable_async_all_gather=true")
_REDUCE_SCATTER_LAYOUT = ("xla_tpu_use_minor_sharding_for_major_trivial_input=true",
                          "xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1",
                          "xla_tpu_assign_all_reduce_scatter_layout=true")
# libtpu lowers a reduce-scatter whose group spans more than one torus dimension (FSDP over
# a whole v6e-256 or v5p slice) as a full all-reduce, twice the bytes; run by the SparseCores
# it stays a reduce-scatter.
_SPARSECORE_REDUCE_SCATTER = ("xla_tpu_enable_sparse_core_collective_offload_nd_reduce_scatter=true",)
_DATA_PARALLEL_OVERLAP = ("xla_tpu_enable_data_parallel_all_reduce_opt=true",
                          "xla_tpu_data_parallel_opt_different_sized_ops=true")
_HOST_OFFLOAD = ("xla_tpu_enable_all_experimental_scheduler_features=true",
                 "xla_tpu_enable_scheduler_memory_pressure_tracking=true",
                 "xla_tpu_host_transfer_overlap_limit=24",
                 "xla_tpu_aggressive_opt_barrier_removal=ENABLED",
                 "xla_lhs_prioritize_async_depth_over_stall=ENABLED",
                 "xla_tpu_enable_ag_backward_pipelining=true",
                 "xla_should_allow_loop_variant_parameter_in_chain=ENABLED",
                 "xla_should_add_loop_invariant_op_in_chain=ENABLED",
                 "xla_max_concurrent_host_send_recv=100",
                 "xla_tpu_scheduler_percent_shared_memory_limit=100",
                 "xla_latency_hiding_scheduler_rerun=2")

PRESETS = {
  "v6e": ("xla_tpu_scoped_vmem_limit_kib=98304",) + _GATHER_OVERLAP + _REDUCE_SCATTER_LAYOUT
         + _SPARSECORE_REDUCE_SCATTER + _DATA_PARALLEL_OVERLAP + _HOST_OFFLOAD,
  "v5p": _GATHER_OVERLAP + _REDUCE_SCATTER_LAYOUT + _SPARSECORE_REDUCE_SCATTER
         + _DATA_PARALLEL_OVERLAP + _HOST_OFFLOAD,
  "v5e": _GATHER_OVERLAP + _DATA_PARALLEL_OVERLAP,
}


def chip_generation(device) -> str | None:
  """`v6e`, `v5p` or `v5e` for a TPU device (also a topology's compile-only device)."""
  if device.platform != "tpu":
    return None
  kind = device.device_kind.lower()  # "TPU v6 lite", "TPU v5 lite", "TPU v5" (v5p)
  for marks, name in ((("v6",), "v6e"), (("v5 lite", "v5e", "v5litepod"), "v5e"), (("v5",), "v5p")):
    if any(m in kind for m in marks):
      return name
  return None


def requested(setting, device) -> tuple[str, ...]:
  """The flag strings `mesh.xla_flags` asks for on this device."""
  if setting == "none":
    return ()
  if setting == "default":
    return PRESETS.get(chip_generation(device), ())
  return tuple(setting)


def parse(flag: str) -> tuple[str, object]:
  """`--xla_foo=true` -> ("xla_foo", True); numbers become ints, other values stay strings."""
  name, _, value = flag.removeprefix("--").partition("=")
  if value.lower() in ("true", "false"):
    return name, value.lower() == "true"
  return name, int(value) if value.lstrip("-").isdigit() else value


def compiler_options(setting, devices) -> tuple[dict, list[str]]:
  """({option: value} for jax.jit, notes on flags left out) for `mesh.xla_flags` on devices."""
  device = devices[0]
  wanted = tuple(parse(flag) for flag in requested(setting, device))
  if not wanted or _rejection(device, wanted) is None:  # usually all pass: one tiny compile
    return dict(wanted), []
  options, notes = {}, []
  for name, value in wanted:
    error = _rejection(device, ((name, value),))
    if error is None:
      options[name] = value
    else:
      notes.append(f"{name}={value} left out: the compiler rejects it for {device.device_kind} ({error})")
      log.warning(notes[-1])
  return options, notes


@functools.lru_cache(maxsize=None)
def _rejection(device, options: tuple) -> str | None:
  """None if a tiny program compiles for `device` with these options, else the error's
  first line."""
  arg = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
  try:
    jax.jit(lambda x: x + 1).lower(arg).compile(dict(options))
  except Exception as e:  # XlaRuntimeError for unknown flags, ValueError for bad values
    return str(e).splitlines()[0][:200]
  return None
