"""YaRN RoPE (GPT-OSS, and any Llama-layout model whose config says rope_type: yarn): a
random-weight `transformers` Llama with GPT-OSS's YaRN settings (factor 32, no truncation)
over positions well past its original context imports with f32 logits parity and exports
back to the same rope parameters and logits; the default attention factor applies."""

import numpy as np
import pytest

from jaxpar.models.rope import attention_factor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 8, "rope_theta": 150000.0}


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_model_imports_with_logits_parity_and_exports(truncate, tmp_path):
  from jaxpar.convert.hf import hf_to_jaxpar, jaxpar_to_hf
  from tests.test_hf import SMALL, _hf_logits, _our_logits, _random_hf_model
  hf_config = transformers.LlamaConfig(**{**SMALL, "head_dim": 32}, rope_parameters={**YARN, "truncate": truncate})
  model = _random_hf_model(hf_config, tmp_path / "hf")
  config = hf_to_jaxpar(tmp_path / "hf", tmp_path / "jaxpar")
  scaling = config.model.rope_scaling
  assert (scaling.rope_type, scaling.truncate, scaling.original_max_position) == ("yarn", truncate, 8)
  assert attention_factor(scaling) == pytest.approx(0.1 * np.log(32.0) + 1)
  tokens = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (2, 48))  # 6x the original context
  expected = _hf_logits(model, tokens)
  np.testing.assert_allclose(_our_logits(tmp_path / "jaxpar", config, tokens), expected, rtol=1e-5,
                             atol=1e-5 * np.abs(expected).max())
  jaxpar_to_hf(tmp_path / "jaxpar", tmp_path / "back")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
  params = reloaded.config.rope_parameters
  assert {k: params[k] for k in YARN} == {**YARN, "truncate": truncate}
  np.testing.assert_array_equal(_hf_logits(reloaded, tokens), expected)
