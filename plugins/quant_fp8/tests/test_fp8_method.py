"""The FP8 arithmetic on the CPU, the checkpoints in the releases' tensor names and dtypes, and each way a
checkpoint or a device can be refused (one line each)."""

from __future__ import annotations

import json

import pytest
import torch
from nanovllm_quant_fp8 import method as fp8_method
from nanovllm_quant_fp8.checkpoints import compressed_tensors_config, write_fp8_checkpoint
from nanovllm_quant_fp8.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_weight,
    quantize_activation,
    quantize_weight_blockwise,
    quantize_weight_per_channel,
    w8a8_reference,
    w8a16_reference,
)
from nanovllm_quant_fp8.method import CompressedTensorsFp8Method, Fp8Method
from nanovllm_testing import write_tiny_checkpoint

from nanovllm_core import LLM, ConfigError, ModelLoadError
from nanovllm_core.loader import iter_safetensors

SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=4, head_dim=64)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_per_channel_quantization_keeps_each_rows_largest_value_and_a_small_error():
    torch.manual_seed(0)
    weight = torch.randn(96, 200) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different magnitudes
    wq, scale = quantize_weight_per_channel(weight)
    assert wq.dtype == FP8_DTYPE and scale.shape == (96,) and scale.dtype == torch.float32
    assert torch.equal(wq.float().abs().amax(dim=1), torch.full((96,), FP8_MAX))
    assert relative_error(dequantize_weight(wq, scale), weight) < 0.04  # e4m3: 3 mantissa bits


def test_block_quantization_scales_each_tile_including_partial_ones():
    torch.manual_seed(1)
    weight = torch.randn(300, 260)
    weight[:128, :128] *= 1000  # one loud tile must not coarsen the others
    wq, scale = quantize_weight_blockwise(weight, (128, 128))
    assert scale.shape == (3, 3)
    assert relative_error(dequantize_weight(wq, scale, (128, 128)), weight) < 0.04
    quiet = (slice(128, 300), slice(0, 260))
    assert relative_error(dequantize_weight(wq, scale, (128, 128))[quiet], weight[quiet]) < 0.04


def test_an_all_zero_row_stays_zero():
    wq, scale = quantize_weight_per_channel(torch.zeros(4, 16))
    assert torch.equal(dequantize_weight(wq, scale), torch.zeros(4, 16))
    xq, x_scale = quantize_activation(torch.zeros(2, 16), 8)
    assert torch.equal(xq.float(), torch.zeros(2, 16)) and bool((x_scale > 0).all())


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_the_reference_products_are_close_to_the_16_bit_product(block):
    torch.manual_seed(2)
    x, weight = torch.randn(5, 384), torch.randn(256, 384) / 20
    wq, scale = quantize_weight_per_channel(weight) if block is None else quantize_weight_blockwise(weight, block)
    exact = x @ weight.t()
    assert relative_error(w8a16_reference(x, wq, scale, block), exact) < 0.04
    assert relative_error(w8a8_reference(x, wq, scale, block), exact) < 0.06  # activations rounded too


def test_checkpoints_use_the_releases_tensor_names_and_dtypes(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16, tie_word_embeddings=False, **SHAPE)
    qwen = dict(iter_safetensors(write_fp8_checkpoint(src, tmp_path / "qwen-fp8", "fp8")))
    name = "model.layers.0.mlp.down_proj"  # [256, 512]
    assert qwen[f"{name}.weight"].dtype == FP8_DTYPE and qwen[f"{name}.weight"].shape == (256, 512)
    assert qwen[f"{name}.weight_scale_inv"].dtype == torch.bfloat16
    assert qwen[f"{name}.weight_scale_inv"].shape == (2, 4)
    assert qwen["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.weight_scale_inv" not in qwen
    config = json.loads((tmp_path / "qwen-fp8" / "config.json").read_text())["quantization_config"]
    assert config == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                      "weight_block_size": [128, 128]}  # fmt: skip
    ct = dict(iter_safetensors(write_fp8_checkpoint(src, tmp_path / "ct", "compressed-tensors")))
    assert ct[f"{name}.weight"].dtype == FP8_DTYPE
    assert ct[f"{name}.weight_scale"].dtype == torch.bfloat16 and ct[f"{name}.weight_scale"].shape == (256, 1)
    assert "model.layers.0.input_layernorm.weight" in ct and "lm_head.weight_scale" not in ct


@pytest.mark.parametrize(
    "config, message",
    [
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
         "static activation scales are not supported"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor scales are not"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "supported are block-wise scales"),
    ],
)  # fmt: skip
def test_fp8_checkpoint_configs_it_cannot_read_are_one_line(config, message):
    with pytest.raises(ModelLoadError, match=message):
        Fp8Method(config)


def test_compressed_tensors_schemes_it_cannot_read_are_one_line():
    weight_only = compressed_tensors_config()
    weight_only["config_groups"]["group_0"]["input_activations"] = None
    with pytest.raises(ModelLoadError, match="supported are dynamic per-token FP8 activations"):
        CompressedTensorsFp8Method(weight_only)
    int8 = compressed_tensors_config()
    int8["config_groups"]["group_0"]["weights"].update(type="int")
    with pytest.raises(ModelLoadError, match=r"weights \{type: 'int'.*supported are FP8 weights"):
        CompressedTensorsFp8Method(int8)
    with pytest.raises(ModelLoadError, match="reads checkpoints stored quantized"):
        CompressedTensorsFp8Method(None)


def test_the_compressed_tensors_ignore_list_and_the_moe_router_stay_16_bit():
    config = compressed_tensors_config()
    config["ignore"] = ["lm_head", "re:.*layers\\.1\\..*", "model.layers.0.mlp.down_proj"]
    method = CompressedTensorsFp8Method(config)
    assert method.linear_method("model.layers.0.self_attn.qkv_proj", None) is not None
    assert method.linear_method("model.layers.0.mlp.down_proj", None) is None
    assert method.linear_method("model.layers.1.self_attn.o_proj", None) is None
    assert Fp8Method(None).linear_method("model.layers.3.mlp.gate", None) is None


def test_a_gpu_without_fp8_gets_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    reason = Fp8Method.check_available(torch.device("cuda", 0))
    assert reason == "FP8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper); this one is 8.0"
    assert Fp8Method.check_available(torch.device("cpu")) is None


def test_block_scales_that_a_tensor_parallel_shard_would_cut_are_refused(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "16bit", "qwen3", hidden_size=256, intermediate_size=320, num_heads=4,
                                num_kv_heads=4, head_dim=64)  # fmt: skip
    path = write_fp8_checkpoint(src, tmp_path / "fp8", "fp8")  # gate and up: 320 rows each, not whole blocks
    with pytest.raises(ModelLoadError, match=r"FP8 block scales of 128 x 128: MergedColumnParallelLinear"):
        LLM(str(path))


def test_on_the_fly_fp8_on_a_checkpoint_stored_as_compressed_tensors_is_refused(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "16bit", "qwen3", **SHAPE)
    path = write_fp8_checkpoint(src, tmp_path / "ct", "compressed-tensors")
    with pytest.raises(ConfigError, match="quantization='fp8' contradicts .* 'compressed-tensors'"):
        LLM(str(path), quantization="fp8")


def test_the_plugin_registers_both_methods():
    from nanovllm_core.plugins import get_registry

    registry = get_registry()
    assert registry.get("quantization", "fp8").obj is Fp8Method
    assert registry.get("quantization", "compressed-tensors").obj is CompressedTensorsFp8Method
    assert fp8_method.MIN_CAPABILITY == (8, 9)


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-channel", "block"])
@pytest.mark.parametrize("rows", [3, 40], ids=["decode rows", "prompt rows"])
def test_the_fp8_product_path_runs_the_kernels_the_gpu_runs(block, rows):
    """``Fp8LinearMethod.apply`` on FP8 weights, as on a GPU (the kernels in Triton's interpreter, ``_scaled_mm``
    on the CPU): the weight-only kernel for a decode step's rows, the FP8 GEMMs for more, each close to its
    reference product."""
    pytest.importorskip("triton")
    from nanovllm_quant_fp8.fp8 import w8a8_reference, w8a16_reference
    from nanovllm_quant_fp8.kernels import MAX_ROWS
    from nanovllm_quant_fp8.method import Fp8LinearMethod
    from torch import nn

    torch.manual_seed(4)
    weight = torch.randn(256, 384) / 20
    wq, scale = quantize_weight_per_channel(weight) if block is None else quantize_weight_blockwise(weight, block)
    layer = nn.Module()
    layer.weight = nn.Parameter(wq, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    x = torch.randn(rows, 384, dtype=torch.bfloat16)
    got = Fp8LinearMethod(block=block).apply(layer, x.view(1, rows, 384))
    assert got.shape == (1, rows, 256) and got.dtype == torch.bfloat16
    reference = w8a16_reference if rows <= MAX_ROWS else w8a8_reference
    assert relative_error(got.view(rows, 256), reference(x, wq, scale, block)) < 0.01


def fp8_layers(block=None) -> tuple:
    """A ``[gate, up]`` projection and a down projection with FP8 weights as a GPU holds them (not dequantized)."""
    from nanovllm_quant_fp8.method import Fp8LinearMethod

    from nanovllm_core.layers import MergedColumnParallelLinear, RowParallelLinear

    torch.manual_seed(5)
    gate_up, down = MergedColumnParallelLinear(256, [384, 384]), RowParallelLinear(384, 256)
    for layer in (gate_up, down):
        layer.set_quant_method(Fp8LinearMethod(block=block))
        weight = torch.randn(layer.output_size, layer.input_size) / 20
        wq, scale = quantize_weight_per_channel(weight) if block is None else quantize_weight_blockwise(weight, block)
        layer.weight = torch.nn.Parameter(wq, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale.float().reshape(-1) if block is None else scale, False)
    return gate_up, down


@pytest.mark.parametrize(
    ("rows", "block"), [(1, None), (1, (128, 128)), (3, None), (40, (128, 128))],
    ids=["one row", "one row, block scales", "decode rows", "prompt rows, block scales"],
)  # fmt: skip
def test_a_decode_steps_norm_and_activation_go_where_they_measured_faster(rows, block, monkeypatch):
    """A decoder layer's MLP half over FP8 layers (``norm_linear`` with ``silu_mul``, then ``down``), as on a GPU
    (the kernels in Triton's interpreter): a decode step's few rows run the RMSNorm's kernel, then the gate-up
    product with the SiLU-and-mul in its epilogue (``w8a16_linear(..., silu_mul=True)``; not one row with block
    scales); one row before the q/k/v
    projection takes the norm into the product's launch (``w8a16_norm_linear``); prompt rows run the steps
    separately. Each way's output is the separate steps', within the roundings the interpreter makes its own
    way (toward zero, where eager PyTorch rounds to nearest)."""
    pytest.importorskip("triton")
    from nanovllm_quant_fp8 import kernels

    from nanovllm_core.layers import QKVParallelLinear, RMSNorm, SiluAndMul, norm_linear

    gate_up, down = fp8_layers(block)
    norm = RMSNorm(256).to(torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    residual = torch.randn(rows, 256, dtype=torch.bfloat16) * 4
    calls = []

    def recorded(name: str):
        real = getattr(kernels, name)
        return lambda *args, **kwargs: calls.append((name, kwargs)) or real(*args, **kwargs)

    for name in ("w8a16_norm_linear", "w8a16_linear"):
        monkeypatch.setattr(kernels, name, recorded(name))
    with torch.no_grad():
        h, want_residual = norm(x, residual)
        want = down(SiluAndMul()(gate_up(h)))  # the separate steps
        calls.clear()
        activated, new_residual = norm_linear(x, norm, residual, gate_up, silu_mul=True)
        decode = rows <= kernels.MAX_ROWS
        in_epilogue = decode and not (block is not None and rows == 1)  # block scales, one row: the separate kernel
        assert calls == ([("w8a16_linear", {"silu_mul": True})] if in_epilogue else [("w8a16_linear", {})] * decode)
        assert torch.equal(new_residual, want_residual)
        assert relative_error(down(activated), want) < 0.02

        qkv = QKVParallelLinear(256, 32, 4, 2)
        qkv.set_quant_method(gate_up.quant_method)
        wq, scale = quantize_weight_per_channel(torch.randn(256, 256) / 20) if block is None else \
            quantize_weight_blockwise(torch.randn(256, 256) / 20, block)  # fmt: skip
        qkv.weight = torch.nn.Parameter(wq, requires_grad=False)
        qkv.weight_scale = torch.nn.Parameter(scale.float().reshape(-1) if block is None else scale, False)
        calls.clear()
        got, new_residual = norm_linear(x, norm, residual, qkv)
        assert [name for name, _ in calls] == (["w8a16_norm_linear"] if rows == 1 else ["w8a16_linear"] * decode)
        assert relative_error(new_residual, want_residual) < 0.01  # the interpreter's sum rounds toward zero
        assert relative_error(got, qkv(h)) < 0.02


def test_the_norm_and_the_activation_stay_out_of_the_products_that_measured_slower():
    """``apply_after_norm`` declines more than one row and rows the product quantizes; ``apply_silu_and_mul``
    declines the latter, and one row with block scales."""
    pytest.importorskip("triton")
    x, weight = torch.randn(40, 256, dtype=torch.bfloat16), torch.ones(256, dtype=torch.bfloat16)
    for block in (None, (128, 128)):
        gate_up, _ = fp8_layers(block)
        method = gate_up.quant_method
        one_row = x[:1]
        fused = method.apply_after_norm(gate_up, one_row, weight, 1e-6, None)
        assert fused is not None and fused[1] is one_row and fused[0].shape == (1, 768)
        assert method.apply_after_norm(gate_up, x[:3], weight, 1e-6, None) is None
        assert method.apply_after_norm(gate_up, x, weight, 1e-6, None) is None
        assert method.apply_silu_and_mul(gate_up, x) is None
        assert (method.apply_silu_and_mul(gate_up, one_row) is None) is (block is not None)
