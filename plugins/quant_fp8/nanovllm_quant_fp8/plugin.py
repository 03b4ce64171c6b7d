"""Entry point of the ``nanovllm`` group: registers the ``fp8`` and ``compressed-tensors`` quantization methods."""

from nanovllm_core import hookimpl
from nanovllm_quant_fp8.method import CompressedTensorsFp8Method, Fp8Method

NANOVLLM_PLUGIN_API = ">=2,<3"  # nanovllm plugin API versions this plugin supports


@hookimpl
def nanovllm_register_quantization_methods(register):
    register("fp8", Fp8Method)
    register("compressed-tensors", CompressedTensorsFp8Method)
