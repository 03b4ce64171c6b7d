"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` on the test server: the token ids the
completion and chat endpoints would send, their text back, and errors that name the field."""

from __future__ import annotations

import httpx
from serving_helpers import ENGINE, MODEL, start_server

import nanovllm_core
from nanovllm_core.entrypoints.chat import render_chat
from nanovllm_core.serving.api_server import ServerSettings

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_tokenize_a_prompt_as_completions_would(server, offline):
    tokenizer = offline.tokenizer
    body = post(server, "/tokenize", {"model": MODEL, "prompt": "The quick brown fox"}).json()
    ids = tokenizer.encode("The quick brown fox")
    assert body == {"count": len(ids), "max_model_len": ENGINE["max_model_len"], "tokens": ids, "token_strs": None}
    bare = post(server, "/tokenize", {"prompt": "The quick brown fox", "add_special_tokens": False,
                                      "return_token_strs": True}).json()  # fmt: skip
    assert bare["tokens"] == tokenizer.encode("The quick brown fox", add_special_tokens=False)
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])


def test_tokenize_messages_as_chat_completions_would(server, offline):
    body = post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    assert body["tokens"] == render_chat(offline.tokenizer, MESSAGES) and body["count"] == len(body["tokens"])
    without = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without["tokens"] == render_chat(offline.tokenizer, MESSAGES, add_generation_prompt=False)
    assert without["tokens"] != body["tokens"]


def test_detokenize_gives_the_text_back(server, offline):
    ids = offline.tokenizer.encode("Hello world, again")
    assert post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {
        "prompt": offline.tokenizer.decode(ids)
    }


def test_bad_bodies_name_the_field(server, offline):
    vocab = len(offline.tokenizer)
    response = post(server, "/detokenize", {"tokens": [1, 2, vocab]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tokens" and f"tokens[2]: {vocab} is not a token id" in error["message"]
    assert f"(0 to {vocab - 1})" in error["message"]
    response = post(server, "/detokenize", {"tokens": [1, -1]})
    assert response.status_code == 400 and "tokens[1]: -1" in response.json()["error"]["message"]
    response = post(server, "/tokenize", {"prompt": 5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    response = post(server, "/tokenize", {"messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    response = post(server, "/tokenize", {"model": "other", "prompt": "x"})
    assert response.status_code == 404 and "this server serves 'tiny-qwen3'" in response.json()["error"]["message"]


def test_version(server):
    assert httpx.get(server.url + "/version").json() == {"version": nanovllm_core.__version__}


def test_a_chat_template_of_the_server_replaces_the_tokenizers(tiny_path, offline):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    settings = ServerSettings(served_model_name=MODEL, chat_template=template)
    thread = start_server(tiny_path, settings)
    try:
        body = post(thread, "/tokenize", {"messages": MESSAGES}).json()
        expected = offline.tokenizer.encode("[system] Be brief.\n[user] Hello world!\n", add_special_tokens=False)
        assert body["tokens"] == expected
        chat = httpx.post(thread.url + "/v1/chat/completions", timeout=30, json={
            "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "ignore_eos": True}).json()  # fmt: skip
        assert chat["usage"]["prompt_tokens"] == len(expected)
    finally:
        thread.stop()


def test_continue_final_message_ends_the_prompt_inside_the_assistants_message(server, offline, client):
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    tokens = post(server, "/tokenize", body).json()["tokens"]
    text = offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("The answer is") and tokens == offline.tokenizer.encode(text, add_special_tokens=False)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert chat.usage.prompt_tokens == len(tokens)
    for bad, message in [
        ({"messages": messages, "continue_final_message": True}, "needs add_generation_prompt=false"),
        ({"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True}, "the assistant's"),
    ]:
        response = post(server, "/tokenize", bad)
        assert response.status_code == 400 and message in response.json()["error"]["message"]
