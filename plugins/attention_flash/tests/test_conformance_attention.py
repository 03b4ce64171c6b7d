"""The conformance kit run against the in-tree attention backends: ``torch`` on the CPU (and, like the GPU
kernels, on CUDA in bfloat16 at two block sizes). The GPU classes skip where ``check_available`` says no."""

import pytest
import torch
from nanovllm_attention_flash.flash_attn_backend import FlashAttnBackend
from nanovllm_attention_flash.torch_backend import TorchAttentionBackend
from nanovllm_attention_flash.triton_backend import TritonAttentionBackend
from nanovllm_testing.conformance import AttentionBackendConformance


class TestTorchAttentionBackend(AttentionBackendConformance):
    backend_cls = TorchAttentionBackend


class OnGpu(AttentionBackendConformance):
    pytestmark = pytest.mark.gpu
    device = "cuda"
    dtype = torch.bfloat16
    atol = 1e-2
    rtol = 1e-2


class TestTorchAttentionBackendCuda(OnGpu):
    backend_cls = TorchAttentionBackend


class TestTritonBlock16(OnGpu):
    backend_cls = TritonAttentionBackend
    block_size = 16


class TestTritonBlock128(OnGpu):
    backend_cls = TritonAttentionBackend
    block_size = 128


class TestFlashAttnBlock16(OnGpu):
    backend_cls = FlashAttnBackend
    block_size = 16


class TestFlashAttnBlock128(OnGpu):
    backend_cls = FlashAttnBackend
    block_size = 128
