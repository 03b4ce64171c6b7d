from int8_weight_only import Int8WeightOnly
from nanovllm_testing import rewrite_checkpoint
from nanovllm_testing.conformance import QuantizationConformance

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rounded_through_int8(name, tensor):
    if not name.endswith(".weight") or name.split(".")[-2] not in LINEAR or ".experts." in name:
        return {name: tensor}
    scale = tensor.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
    return {name: (tensor / scale).round() * scale}


class TestInt8WeightOnly(QuantizationConformance):
    method_cls = Int8WeightOnly
    method_name = "int8"  # registered under this name for the run (the plugin is not installed)

    def quantize_checkpoint(self, src, dst):
        return src, {"quantization": "int8"}  # quantized as it loads

    def reference_checkpoint(self, src, quantized, dst):
        return rewrite_checkpoint(src, dst, rounded_through_int8)
