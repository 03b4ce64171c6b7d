"""The engine config on its own: precedence of its sources, strict validation, errors that name the field."""

from __future__ import annotations

import pytest

from nanovllm_core import ConfigError, EngineConfig


def write(tmp_path, text):
    path = tmp_path / "nanovllm.toml"
    path.write_text(text)
    return path


def test_precedence_cli_over_kwargs_over_file_over_defaults(tmp_path):
    path = write(tmp_path, 'model = "/m"\nmax_num_seqs = 8\nmax_model_len = 100\n[plugins]\nattention = "torch"\n')
    config = EngineConfig.load(path, {"max_num_seqs": 16, "plugins": {"scheduler": "fifo"}}, {"max_num_seqs": 32})
    assert config.max_num_seqs == 32 and config.source_of("max_num_seqs") == "command line"
    assert config.max_model_len == 100 and config.source_of("max_model_len") == f"file {path}"
    assert config.plugins.attention == "torch" and config.plugins.scheduler == "fifo"
    assert config.source_of("plugins.scheduler") == "keyword argument"
    assert config.kvcache_block_size == 256 and config.source_of("kvcache_block_size") == "default"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"kvcache_block_size": 48}, "kvcache_block_size: .*power of two from 16 to 256"),
        ({"kvcache_block_size": 512}, "kvcache_block_size"),
        ({"dtype": "int8"}, "dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"),
        ({"device": "tpu"}, "device: Input should be 'auto', 'cpu' or 'cuda'"),
        ({"max_num_seqs": 0}, "max_num_seqs: .*greater than or equal to 1"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_seqs .* must not exceed"),
        ({"maxnumseqs": 1}, "maxnumseqs: unknown field; allowed fields: model, "),
        ({"plugins": {"schedulr": "fifo"}}, "plugins.schedulr: unknown field; allowed fields: scheduler"),
        ({"seed": 2**64}, "seed: must be an unsigned 64-bit integer, 0 to 2\\*\\*64 - 1"),
        ({"seed": -1}, "seed: must be an unsigned 64-bit integer"),
        ({"enforce_eager": "yes"}, "enforce_eager: Input should be a valid boolean; strings are not converted"),
        ({"max_num_seqs": "64"}, "max_num_seqs: Input should be a valid integer; strings are not converted"),
        ({"max_num_seqs": 64.0}, "max_num_seqs: Input should be a valid integer"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching: Input should be a valid boolean"),
        ({"plugins": {"scheduler": 3}}, "plugins.scheduler: Input should be a valid string"),
    ],
)
def test_invalid_values_name_field_and_allowed(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        EngineConfig.load(None, {"model": "/m", **overrides})


def test_kv_cache_dtype_takes_vllms_name_for_e4m3():
    """``fp8_e4m3`` (vLLM's spelling) is the e4m3 cache and reads as ``fp8``; e5m2 is refused naming what is allowed."""
    assert EngineConfig.load(None, {"model": "/m", "kv_cache_dtype": "fp8_e4m3"}).kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="kv_cache_dtype: Input should be 'auto', 'fp8' or 'fp8_e4m3'"):
        EngineConfig.load(None, {"model": "/m", "kv_cache_dtype": "fp8_e5m2"})


def test_missing_model_is_reported():
    with pytest.raises(ConfigError, match="model: Field required"):
        EngineConfig.load(None, {})


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        EngineConfig.load(write(tmp_path, "model = "))
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig.load(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a directory; give the path of a TOML file"):
        EngineConfig.load(tmp_path)


def test_strict_in_files_too(tmp_path):
    with pytest.raises(ConfigError, match="max_num_seqs: Input should be a valid integer.*got '64'"):
        EngineConfig.load(write(tmp_path, 'model = "/m"\nmax_num_seqs = "64"\n'))
    with pytest.raises(ConfigError, match="enforce_eager: Input should be a valid boolean.*got 'yes'"):
        EngineConfig.load(write(tmp_path, 'model = "/m"\nenforce_eager = "yes"\n'))


def test_what_strict_still_accepts(tmp_path):
    config = EngineConfig.load(None, {"model": tmp_path, "gpu_memory_utilization": 1, "seed": 2**64 - 1})
    assert config.model == str(tmp_path) and config.gpu_memory_utilization == 1.0 and config.seed == 2**64 - 1
