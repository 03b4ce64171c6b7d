"""The engine config and plugin options as the engine applies them: plugins that are not installed, limits of
the checkpoint, options checked before any weights load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nanovllm_core import LLM, ConfigError, UnknownPluginError
from nanovllm_core.engine.model_runner import ModelRunner


def test_unknown_plugin_lists_installed(qwen3_path):
    with pytest.raises(UnknownPluginError, match="no scheduler named 'lifo'.*installed: fifo"):
        LLM(str(qwen3_path), plugins={"scheduler": "lifo"})
    with pytest.raises(UnknownPluginError, match="no attention named 'flash9'.*torch"):
        LLM(str(qwen3_path), plugins={"attention": "flash9"})


def test_config_file_selects_plugins_and_limits(tmp_path, qwen3_path):
    path = tmp_path / "nanovllm.toml"
    path.write_text(
        f'model = "{qwen3_path}"\nmax_model_len = 128\nnum_kvcache_blocks = 20\n'
        'kvcache_block_size = 32\n[plugins]\nattention = "torch"\n'
    )
    llm = LLM(config=path, max_num_seqs=4)
    assert llm.config.max_num_seqs == 4 and llm.config.max_model_len == 128
    assert llm.block_manager.num_blocks == 20 and llm.block_manager.block_size == 32
    assert llm.attention_backend_name == "torch"


def test_unknown_plugin_option_is_a_config_error(qwen3_path):
    with pytest.raises(ConfigError, match="block_manager_options.*not accepted by PrefixCachingBlockManager"):
        LLM(str(qwen3_path), num_kvcache_blocks=8, plugins={"block_manager_options": {"colour": "red"}})


def test_max_model_len_above_model_limit(qwen3_path):
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        LLM(str(qwen3_path), max_model_len=100000)


def test_unknown_attention_option_is_a_config_error(qwen3_path):
    with pytest.raises(ConfigError, match=r"attention_options \['tile'\] not accepted by TorchAttentionBackend"):
        LLM(str(qwen3_path), num_kvcache_blocks=8, plugins={"attention": "torch", "attention_options": {"tile": 4}})


def test_flash_attn_backend_rejects_options_before_loading_anything():
    from nanovllm_attention_flash import FlashAttnBackend

    with pytest.raises(ConfigError, match=r"attention_options \['tile'\] not accepted by FlashAttnBackend"):
        FlashAttnBackend(2, 1, 64, 0.125, 16, None, None, tile=4)


# --- the engine checks every plugin's options before it loads weights ------------------------------


@pytest.mark.parametrize(
    "plugins, expected",
    [
        ({"scheduler_options": {"colour": "red"}}, r"scheduler_options \['colour'\] not accepted by FifoScheduler"),
        ({"block_manager_options": {"size": 2}}, r"block_manager_options \['size'\] not accepted"),
        ({"attention_options": {"tile": 4}}, r"attention_options \['tile'\] not accepted by TorchAttentionBackend"),
    ],
)
def test_the_engine_rejects_options_before_any_weights_load(
    qwen3_path: Path, monkeypatch: pytest.MonkeyPatch, plugins: dict[str, Any], expected: str
) -> None:
    def no_runner(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model runner (weights, KV cache) was built before the options were checked")

    monkeypatch.setattr(ModelRunner, "__init__", no_runner)
    with pytest.raises(ConfigError, match=expected):
        LLM(str(qwen3_path), device="cpu", num_kvcache_blocks=8, plugins={"attention": "torch", **plugins})
