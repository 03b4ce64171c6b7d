"""Entry point of the ``nanovllm`` group: registers the Qwen architectures by their HF names."""

from nanovllm_core import hookimpl
from nanovllm_models_qwen3.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from nanovllm_models_qwen3.qwen3_moe import Qwen3MoeForCausalLM

NANOVLLM_PLUGIN_API = ">=2,<3"  # nanovllm plugin API versions this plugin supports


@hookimpl
def nanovllm_register_models(register):
    register("Qwen3ForCausalLM", Qwen3ForCausalLM)
    register("Qwen2ForCausalLM", Qwen2ForCausalLM)
    register("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)
