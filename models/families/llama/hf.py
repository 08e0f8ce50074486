"""Hugging Face names for the `llama` family: Llama 2/3 (rope scaling), Mistral (sliding
window), Qwen2/2.5 (q/k/v biases), Qwen3 (qk-norm). Every tensor and field is the shared
decoder layout (models/hf_layout.py); what is the family's own is which HF architecture a
config becomes."""

from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig
from jaxpar.models.hf_layout import LAYER, TOP, decoder_config_from_hf, decoder_config_to_hf, windows_to_hf
from jaxpar.models.layer_pattern import layer_options
from jaxpar.models.registry import HFMapping

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
  kind = "qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias else "llama"
  if cfg.mlp != "dense":
    raise ConfigError(f"model.mlp={cfg.mlp!r} has no Hugging Face architecture in the llama family")
  if kind == "llama" and any(layer_options(cfg, i).attention.sliding_window for i in range(cfg.num_layers)):
    kind = "mistral"  # Llama with a sliding window
  return {"architectures": [ARCHITECTURES[kind]], "model_type": kind, **decoder_config_to_hf(cfg, dtype),
          **windows_to_hf(cfg, kind)}


MAPPING = HFMapping(model_types=tuple(ARCHITECTURES), config_from_hf=decoder_config_from_hf,
                    config_to_hf=config_to_hf, top=TOP, layer=LAYER)
