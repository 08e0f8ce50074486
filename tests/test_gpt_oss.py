"""GPT-OSS from a random-weight `transformers` GptOss at small, unusual shapes (3 query
heads per kv head, head_dim 12, untied output head, a window of 8 under 40+ tokens, YaRN
over 32 positions, 2 of 4 experts, a SwiGLU clamp of 0.5 that the projections cross):
import with f32 logits parity, export back bit-exact, greedy generation through the
engine's paged cache equal to transformers.generate for 40 tokens; gpt-oss-20b's
parameters are transformers' and its FLOPs count only the active experts. (A train step on
8 devices, fsdp x tensor x expert, equal to one device's: tests/test_moe_parallel.py.)"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW, PAGE = 8, 4
HF_SHAPES = dict(vocab_size=320, hidden_size=48, intermediate_size=20, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=12, num_local_experts=4, num_experts_per_tok=2,
                 sliding_window=WINDOW, max_position_embeddings=128, tie_word_embeddings=False, swiglu_limit=0.5,
                 swiglu_alpha=1.5, eos_token_id=None,  # greedy may pick any token: nothing stops
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 10000.0})


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
  from tests.test_hf import import_random_hf
  directory = tmp_path_factory.mktemp("gpt_oss")
  return (*import_random_hf(transformers.GptOssConfig(**HF_SHAPES), directory), directory)


def test_imports_with_logits_parity_and_exports_exactly(gpt_oss):
  from tests.test_hf import assert_round_trip
  model, config, directory = gpt_oss
  m = config.model
  assert (m.family, m.num_kv_heads, m.tie_embeddings, m.attention_sinks, m.attention_out_bias) == \
      ("gpt_oss", 2, False, True, True)
  assert [k.sliding_window for k in m.layer_pattern] == [WINDOW, None]
  assert (m.moe.activation, m.moe.swiglu_limit, m.moe.router_bias, m.moe.expert_bias) == \
      ("clamped_swiglu", 0.5, True, True)
  reloaded = assert_round_trip(model, config, directory)
  assert reloaded.config.layer_types == model.config.layer_types
  assert reloaded.config.rope_parameters == model.config.rope_parameters


def test_generates_like_transformers_past_the_window(gpt_oss):
  from tests.test_hf import assert_generates_like_transformers
  model, _, directory = gpt_oss
  assert_generates_like_transformers(model, directory, max_tokens=40, page_size=PAGE)  # 32 past the window of 8


def test_gpt_oss_20b_has_the_real_models_parameters_and_counts_active_experts():
  """At real size our parameter count equals transformers' for the config we would export
  (built on the meta device: no memory), and a token's FLOPs count its 4 experts, not 32."""
  from jaxpar.config import load_config
  from jaxpar.convert.hf import hf_config_from_model
  from jaxpar.models import get_family
  from jaxpar.runtime import abstract_model, count_params
  model = load_config("gpt-oss-20b").model
  hf_config = hf_config_from_model(model, "bfloat16")
  with torch.device("meta"):
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config))
  total = count_params(abstract_model(model)[1])
  assert total == sum(p.numel() for p in hf_model.parameters())
  assert 20.5e9 < total < 21.5e9  # "21B parameters"
  assert hf_model.config.layer_types == ["sliding_attention", "full_attention"] * 12
  flops = get_family("gpt_oss").flops_per_token
  every_expert = model.model_copy(update={"moe": model.moe.model_copy(update={"experts_per_token": 32})})
  idle = 6 * model.num_layers * 28 * 3 * model.embed_dim * model.moe.expert_mlp_dim
  assert flops(every_expert, 4096) - flops(model, 4096) == idle


def test_what_gpt_oss_cannot_say_is_a_one_line_error():
  from jaxpar.config import from_dict
  from jaxpar.convert.hf import hf_config_from_model, model_config_from_hf
  from jaxpar.errors import ConfigError
  model = from_dict({"model": {"family": "gpt_oss", "moe": {"num_experts": 4, "expert_bias": False}}}).model
  assert model.moe.router_bias and model.moe.activation == "clamped_swiglu"  # the family's defaults stay
  with pytest.raises(ConfigError, match=r"model.moe.expert_bias=False has no Hugging Face gpt_oss equivalent"):
    hf_config_from_model(model, "float32")
  two_windows = {"family": "gpt_oss", "layer_pattern": [{"sliding_window": 8}, {"sliding_window": 16}]}
  with pytest.raises(ConfigError, match="takes one sliding_window"):
    hf_config_from_model(from_dict({"model": two_windows}).model, "float32")
  with pytest.raises(ConfigError, match="hidden_act='gelu'"):
    model_config_from_hf({**transformers.GptOssConfig(**HF_SHAPES).to_dict(), "hidden_act": "gelu"})
