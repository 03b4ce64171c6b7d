"""The quantization kit: :class:`QuantizationConformance`."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from nanovllm_core.engine.config_resolver import create_engine_config
from nanovllm_core.engine.model_core import ModelEngineCore
from nanovllm_core.layers.linear import UNQUANTIZED, _Linear
from nanovllm_core.plugins import check_registration, get_registry
from nanovllm_core.quantization import QuantizationMethod
from nanovllm_testing.conformance._shared import (
    assert_matches_transformers,
    fixture,
    installed_plugin,
    parametrize,
    registered_for_test,
    run_engine,
)

if TYPE_CHECKING:
    import pytest

FAMILIES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_OPTIONS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)


class QuantizationConformance:
    """Checks a quantization method on tiny checkpoints of every installed model family, against ``transformers``
    run on the weights the method computes with.

    Set ``method_cls`` in a ``Test...`` subclass and write :meth:`quantize_checkpoint` (the checkpoint the engine
    loads, from a 16-bit one, and the engine settings that load it) and :meth:`reference_checkpoint` (a 16-bit
    checkpoint of the weights the method computes with: dequantized). On the CPU a method computes with its
    dequantized weights, so the engine's greedy output equals the reference's token for token.

    The checkpoints have dimensions that are multiples of 128 (as real models' are), so that block-wise formats
    apply, and enough heads to split over two tensor-parallel ranks.
    """

    method_cls: ClassVar[type[QuantizationMethod]]
    method_name: ClassVar[str | None] = None  # the name the settings use; default: the one it is installed under
    attention: ClassVar[str] = "torch"
    max_new_tokens: ClassVar[int] = 8
    unquantized_suffixes: ClassVar[tuple[str, ...]] = (".mlp.gate",)
    """Linear layers the method may leave in 16 bits (an MoE router); every other one must be quantized."""
    checkpoint_shape: ClassVar[dict[str, Any]] = dict(
        hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=4, head_dim=64, num_layers=2
    )

    def quantize_checkpoint(self, src: Path, dst: Path) -> tuple[Path, dict[str, Any]]:
        """``(path, engine_settings)``: the checkpoint to load, written from the 16-bit ``src`` into ``dst`` (or
        ``src`` itself, for a method that quantizes at load), and the engine settings it needs
        (``{"quantization": "fp8"}``)."""
        raise NotImplementedError("write quantize_checkpoint(src, dst) in the Test... subclass")

    def reference_checkpoint(self, src: Path, quantized: Path, dst: Path) -> Path:
        """A 16-bit checkpoint in ``dst`` of the weights the method computes with when it loads ``quantized``
        (written from the 16-bit ``src``)."""
        raise NotImplementedError("write reference_checkpoint(src, quantized, dst) in the Test... subclass")

    @fixture(scope="class")
    @classmethod
    def checkpoints(cls, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any], Path]]:
        """Per model family: (quantized checkpoint, engine settings, reference checkpoint)."""
        from nanovllm_testing.checkpoints import write_tiny_checkpoint

        kit = cls()
        found = {}
        for family in FAMILIES:
            root = tmp_path_factory.mktemp(f"quantization-{family}")
            options = dict(cls.checkpoint_shape, **(MOE_OPTIONS if family == "qwen3_moe" else {}))
            src = write_tiny_checkpoint(root / "16bit", family, tie_word_embeddings=False, **options)
            quantized, settings = kit.quantize_checkpoint(src, root / "quantized")
            found[family] = (quantized, settings, kit.reference_checkpoint(src, quantized, root / "reference"))
        return found

    def engine(self, checkpoint: Path, settings: dict[str, Any], **overrides: Any) -> ModelEngineCore:
        installed_plugin("attention", self.attention, "attention")
        values = dict(
            model=str(checkpoint), device="cpu", dtype="float32", num_kvcache_blocks=64, kvcache_block_size=16,
            max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, plugins={"attention": self.attention},
        )  # fmt: skip
        return ModelEngineCore(create_engine_config(**{**values, **settings, **overrides}))

    @contextmanager
    def family_engine(self, checkpoints: dict, family: str) -> Iterator[tuple[ModelEngineCore, Path]]:
        """The engine on ``family``'s quantized checkpoint, with the method registered, and the reference
        checkpoint; skipped where the family's model plugin is not installed."""
        installed_plugin("model", FAMILIES[family], "a model plugin")
        quantized, settings, reference = checkpoints[family]
        with registered_for_test("quantization", self.method_cls, self.method_name):
            yield self.engine(quantized, settings), reference

    def prompts(self, vocab: int = 384) -> list[list[int]]:
        rng = random.Random(3)
        return [[rng.randrange(3, vocab) for _ in range(n)] for n in (37, 3, 70)]

    def test_registers_as_a_quantization_method(self) -> None:
        problem = check_registration("quantization", self.method_cls)
        assert problem is None, problem

    @parametrize("family", list(FAMILIES), ids=list(FAMILIES))
    def test_greedy_matches_transformers_on_the_dequantized_weights(self, checkpoints: dict, family: str) -> None:
        """Ragged prompts and chunked prefill, each model family, against ``transformers`` on the reference."""
        with self.family_engine(checkpoints, family) as (engine, reference):
            got = run_engine(engine, self.prompts(), self.max_new_tokens)
        assert_matches_transformers(reference, self.prompts(), got, self.max_new_tokens)

    @parametrize("family", list(FAMILIES), ids=list(FAMILIES))
    def test_every_linear_layer_is_quantized(self, checkpoints: dict, family: str) -> None:
        with self.family_engine(checkpoints, family) as (engine, _):
            layers = [(n, m) for n, m in engine.runner.model.named_modules() if isinstance(m, _Linear)]
        left = [n for n, m in layers if m.quant_method is UNQUANTIZED and not n.endswith(self.unquantized_suffixes)]
        assert layers and not left, f"linear layers left unquantized: {left}"

    def test_tensor_parallel_shards_weights_and_scales(self, checkpoints: dict) -> None:
        """Two CPU ranks (each a shard of every weight and scale) produce the one-rank tokens."""
        import pytest

        installed_plugin("model", FAMILIES["qwen3"], "a model plugin")
        if not any(r.obj is self.method_cls for r in get_registry().registrations["quantization"].values()):
            pytest.skip("tensor-parallel workers load installed plugins only: install the plugin to run this check")
        quantized, settings, reference = checkpoints["qwen3"]
        with registered_for_test("quantization", self.method_cls, self.method_name):
            engine = self.engine(quantized, settings, tensor_parallel_size=2)
            try:
                got = run_engine(engine, self.prompts(), self.max_new_tokens)
            finally:
                engine.shutdown()
        assert_matches_transformers(reference, self.prompts(), got, self.max_new_tokens)
