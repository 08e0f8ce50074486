"""The gated activations of every feed-forward block, by name: one table that the dense MLP
(`model.mlp_activation`), the experts (`moe.activation`) and every Hugging Face mapping read.

A gated activation turns the two projections of a token into the hidden activation:
silu(gate) * up is SwiGLU, gelu(gate) * up GeGLU. `hf_names` are the `hidden_act` /
`hidden_activation` values of a Hugging Face config that mean it; export writes the first.
A family with an activation of its own registers it (`register_activation`) when it loads.
"""

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError
from jaxpar.pallas_kernels.moe import silu_glu


def clamped_swiglu(gate, up, *, limit: float, alpha: float):
  """GPT-OSS's expert activation: (up + 1) x gate x sigmoid(alpha x gate), with the gate
  clamped above at `limit` and up to [-limit, limit]."""
  gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
  return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


@dataclasses.dataclass(frozen=True)
class Activation:
  glu: Callable  # (gate, up, **options) -> hidden
  hf_names: tuple[str, ...]
  options: tuple[tuple[str, str], ...] = ()  # (glu keyword, the config field that sets it)


ACTIVATIONS = {
  "silu": Activation(silu_glu, ("silu",)),
  "gelu_tanh": Activation(lambda gate, up: jax.nn.gelu(gate, approximate=True) * up,  # GELU's tanh form
                          ("gelu_pytorch_tanh", "gelu_tanh")),
  # GPT-OSS's experts (its HF config says silu).
  "clamped_swiglu": Activation(clamped_swiglu, ("silu",), (("limit", "swiglu_limit"), ("alpha", "swiglu_alpha"))),
}


def register_activation(name: str, activation: Activation) -> Activation:
  """Add `name` to the table (model.mlp_activation and moe.activation may then name it)."""
  if name in ACTIVATIONS and ACTIVATIONS[name] != activation:
    raise ValueError(f"activation {name!r} is already registered as another function")
  ACTIVATIONS[name] = activation
  return activation


def check_activation(name: str) -> str:
  """`name` if the table has it, else an error naming the choices (the config adds the key)."""
  if name not in ACTIVATIONS:
    raise ValueError(f"not an activation; choose one of {sorted(ACTIVATIONS)}")
  return name


def gated(name: str, config=None) -> Callable:
  """The (gate, up) -> hidden function of activation `name`, its options read from `config`
  (the section that names it)."""
  activation = ACTIVATIONS[name]
  if not activation.options:
    return activation.glu
  return functools.partial(activation.glu, **{k: getattr(config, field) for k, field in activation.options})


def from_hf(hf: dict, kind: str, supported: tuple[str, ...]) -> str:
  """The activation of an HF config (`hidden_activation`, else `hidden_act`, default silu) among
  the family's `supported` ones, or a one-line error."""
  value = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
  found = [name for name in supported if value in ACTIVATIONS[name].hf_names]
  if not found:
    names = sorted({n for name in supported for n in ACTIVATIONS[name].hf_names})
    raise ConfigError(f"{kind} with hidden_act={value!r} is not supported: jaxpar's {kind} takes {names}")
  return found[0]


def hf_name(name: str) -> str:
  """What an HF config calls activation `name`."""
  return ACTIVATIONS[name].hf_names[0]
