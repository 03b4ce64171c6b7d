"""The model kit: :class:`ModelConformance`."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from nanovllm_core.engine.config_resolver import create_engine_config
from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.errors import ModelLoadError
from nanovllm_core.loader import iter_safetensors, load_hf_config
from nanovllm_core.plugins import check_registration
from nanovllm_testing.checkpoints import write_tiny_checkpoint
from nanovllm_testing.conformance._shared import (
    assert_matches_transformers,
    fixture,
    installed_plugin,
    registered_for_test,
    run_engine,
    shared_tiny_checkpoint,
)

if TYPE_CHECKING:
    import pytest


class ModelConformance:
    """Checks a model class; set ``model_cls`` (and ``checkpoint_arch``) in a ``Test...`` subclass.

    The checkpoint is a tiny random-weight one from :func:`~nanovllm_testing.write_tiny_checkpoint`
    (``checkpoint_arch``, ``checkpoint_options``); override :meth:`write_checkpoint` for other architectures.
    """

    model_cls: ClassVar[type[torch.nn.Module]]
    architecture: ClassVar[str | None] = None  # default: model_cls.__name__
    checkpoint_arch: ClassVar[str] = "qwen3"
    checkpoint_options: ClassVar[dict[str, Any]] = {}
    attention: ClassVar[str] = "torch"
    max_new_tokens: ClassVar[int] = 8

    def write_checkpoint(self, path: Path) -> Path:
        """Write a tiny checkpoint of this architecture (``config.json``, safetensors, tokenizer) into ``path``."""
        return write_tiny_checkpoint(path, self.checkpoint_arch, **self.checkpoint_options)

    @fixture(scope="class")
    @classmethod
    def model_checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        if cls.write_checkpoint is ModelConformance.write_checkpoint:
            return shared_tiny_checkpoint(tmp_path_factory, cls.checkpoint_arch, **cls.checkpoint_options)
        return cls().write_checkpoint(tmp_path_factory.mktemp(f"conformance-{cls.model_cls.__name__}"))

    def get_architecture(self) -> str:
        return self.architecture or self.model_cls.__name__

    def test_implements_the_causal_lm_protocol(self) -> None:
        problem = check_registration("model", self.model_cls)
        assert problem is None, problem

    def test_checkpoint_names_the_architecture(self, model_checkpoint: Path) -> None:
        names = json.loads((model_checkpoint / "config.json").read_text()).get("architectures") or []
        assert names[:1] == [self.get_architecture()], (
            f"config.json names architectures {names}; the engine looks up architectures[0], so register the "
            f"class as {names[:1] or '?'} or set `architecture`"
        )

    def test_load_weights_rejects_an_incomplete_checkpoint(self, model_checkpoint: Path) -> None:
        import pytest
        hf_config = load_hf_config(model_checkpoint)
        weights = list(iter_safetensors(model_checkpoint))
        dropped = next((name for name, _ in weights if "layers." in name), weights[-1][0])
        model = self.model_cls(hf_config)
        with pytest.raises(ModelLoadError):
            model.load_weights([(n, t) for n, t in weights if n != dropped])
        model.load_weights(weights)

    def test_greedy_matches_transformers(self, model_checkpoint: Path) -> None:
        """Ragged prompts, chunked prefill (32-token budget) and a prefix-cache hit, against ``transformers``."""
        installed_plugin("attention", self.attention, "attention")
        vocab = load_hf_config(model_checkpoint).vocab_size
        rng = random.Random(8)
        first = [rng.randrange(3, vocab) for _ in range(37)]
        prompts = [first, [rng.randrange(3, vocab) for _ in range(3)], [rng.randrange(3, vocab) for _ in range(70)],
                   first[:32] + [rng.randrange(3, vocab) for _ in range(3)]]
        with registered_for_test("model", self.model_cls, name=self.get_architecture()):
            engine = ModelEngineCore(create_engine_config(
                model=str(model_checkpoint), device="cpu", dtype="float32", num_kvcache_blocks=64,
                kvcache_block_size=16, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
                plugins={"attention": self.attention},
            ))
            got = run_engine(engine, prompts, self.max_new_tokens)
        assert_matches_transformers(model_checkpoint, prompts, got, self.max_new_tokens)
