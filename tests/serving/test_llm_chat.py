"""``LLM.chat``: conversations through the tokenizer's chat template, and a clear error without one."""

from __future__ import annotations

import pytest
from nanovllm_testing import write_tiny_checkpoint
from serving_helpers import ENGINE

from nanovllm_core import LLM, InvalidRequestError, SamplingParams
from nanovllm_core.entrypoints.chat import render_chat

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


def test_chat_renders_the_template_and_generates(offline):
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n"
    ids = render_chat(offline.tokenizer, CHAT)
    assert ids == offline.tokenizer.encode(text, add_special_tokens=False)
    [out] = offline.chat(CHAT, PARAMS, use_tqdm=False)
    [ref] = offline.generate([ids], PARAMS, use_tqdm=False)
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == ref.outputs[0].token_ids
    both = offline.chat([CHAT, CHAT[1:]], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in both][0] == ref.outputs[0].token_ids
    assert both[1].prompt_token_ids == render_chat(offline.tokenizer, CHAT[1:])
    no_prompt = offline.chat(CHAT, PARAMS, use_tqdm=False, add_generation_prompt=False)[0]
    assert no_prompt.prompt_token_ids == render_chat(offline.tokenizer, CHAT, add_generation_prompt=False) != ids


def test_chat_continues_the_final_message(offline):
    chat = [*CHAT, {"role": "assistant", "content": "Hi, I"}]
    [out] = offline.chat(chat, PARAMS, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    text = offline.tokenizer.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert text.endswith("Hi, I") and out.prompt_token_ids == offline.tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="needs add_generation_prompt=False"):
        offline.chat(chat, PARAMS, use_tqdm=False, continue_final_message=True)


def test_chat_without_a_template_is_a_clear_error(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3", chat_template=None)
    llm = LLM(str(path), **ENGINE)
    with pytest.raises(InvalidRequestError, match="has no chat template") as err:
        llm.chat(CHAT, PARAMS)
    assert "chat_template=" in str(err.value)
    [out] = llm.chat(
        CHAT, PARAMS, use_tqdm=False, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    assert out.prompt_token_ids == llm.tokenizer.encode("Be brief.Hello world!", add_special_tokens=False)


def test_chat_rejects_bad_messages(offline):
    with pytest.raises(InvalidRequestError, match="non-empty list"):
        offline.chat([], PARAMS)
    with pytest.raises(InvalidRequestError, match="role"):
        offline.chat([{"content": "no role"}], PARAMS)
    with pytest.raises(InvalidRequestError, match="chat template rejected"):
        offline.chat(CHAT, PARAMS, chat_template="{{ raise_exception('only users here') }}")
