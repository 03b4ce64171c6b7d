"""An ``int8`` quantization method: each linear weight rounded to int8 with a scale per output channel at load,
multiplied in the model's dtype (weight-only: half the bytes of bf16 at rest, the plain product)."""

import torch
from torch import nn

from nanovllm_core import LinearMethod, QuantizationMethod, hookimpl
from nanovllm_core.distributed import all_reduce
from nanovllm_core.layers import RowParallelLinear

NANOVLLM_PLUGIN_API = ">=2,<3"


class Int8WeightOnlyLinear(LinearMethod):
    def create_weights(self, layer, input_size, output_size, output_sizes, dtype):
        # the checkpoint is 16-bit: load the weight as it is, quantize it once it is loaded
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer):
        weight = layer.weight.data
        amax = weight.abs().amax(dim=1, keepdim=True).float()
        if isinstance(layer, RowParallelLinear):  # this rank holds part of each row: scale to the whole row
            amax = all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
        scale = amax.clamp(min=1e-8) / 127
        layer.weight = nn.Parameter((weight / scale).round().to(torch.int8), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.to(weight.dtype), requires_grad=False)

    def apply(self, layer, x, bias=None):
        return nn.functional.linear(x, layer.weight.to(x.dtype) * layer.weight_scale, bias)


class Int8WeightOnly(QuantizationMethod):
    quantizes_on_load = True
    weight_bits = 8

    def linear_method(self, prefix, layer):
        return None if prefix.endswith(".mlp.gate") else Int8WeightOnlyLinear()  # an MoE router stays 16-bit


@hookimpl
def nanovllm_register_quantization_methods(register):
    register("int8", Int8WeightOnly)
