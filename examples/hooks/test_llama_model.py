from pathlib import Path

import transformers
from llama_model import LlamaForCausalLM
from nanovllm_testing import build_tokenizer
from nanovllm_testing.conformance import ModelConformance


class TestLlamaForCausalLM(ModelConformance):
    model_cls = LlamaForCausalLM

    def write_checkpoint(self, path: Path) -> Path:
        """A tiny random-weight Llama written by transformers itself: the reference the kit compares with."""
        tokenizer = build_tokenizer()
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, architectures=["LlamaForCausalLM"],
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        )
        transformers.LlamaForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path
