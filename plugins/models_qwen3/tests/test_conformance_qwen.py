"""The conformance kit run against the in-tree Qwen architectures."""

from nanovllm_models_qwen3 import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM
from nanovllm_testing.conformance import ModelConformance


class TestQwen3ForCausalLM(ModelConformance):
    model_cls = Qwen3ForCausalLM
    checkpoint_arch = "qwen3"


class TestQwen2ForCausalLM(ModelConformance):
    model_cls = Qwen2ForCausalLM
    checkpoint_arch = "qwen2"


class TestQwen3MoeForCausalLM(ModelConformance):
    model_cls = Qwen3MoeForCausalLM
    checkpoint_arch = "qwen3_moe"
    checkpoint_options = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96)
