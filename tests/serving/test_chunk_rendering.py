"""The streamed chunks the server builds directly (no logprobs: the common case) are the JSON the pydantic
models render, field for field, for any text, finish and stop reason, response id and model name."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from nanovllm_core.outputs import CompletionOutput
from nanovllm_core.serving.openai_serving import Job
from nanovllm_core.serving.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)

names = st.text(max_size=12)
completions = st.builds(
    CompletionOutput,
    index=st.integers(0, 3),
    text=st.text(max_size=20),
    token_ids=st.just([1]),
    finish_reason=st.sampled_from([None, "stop", "length", "abort"]),
    stop_reason=st.one_of(st.none(), st.integers(0, 2**31), st.text(max_size=5)),
)


def event_json(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n") and "\n" not in event[:-2]
    return json.loads(event[len("data: ") : -2])


@given(names, names, st.integers(0, 7), completions)
def test_completion_chunk_equals_the_model(response_id, model, index, c):
    job = Job(None, response_id, model, [], 1, None)  # type: ignore[arg-type]
    choice = CompletionChoice(index=index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
    want = CompletionResponse(id=response_id, created=job.created, model=model, choices=[choice]).model_dump_json()
    assert event_json(job.completion_chunk(index, c)) == json.loads(want)


@given(names, names, st.integers(0, 7), completions)
def test_chat_chunk_equals_the_model(response_id, model, index, c):
    job = Job(None, response_id, model, [], 1, None)  # type: ignore[arg-type]
    choice = ChatStreamChoice(
        index=index, delta=DeltaMessage(content=c.text), finish_reason=c.finish_reason, stop_reason=c.stop_reason
    )
    want = ChatCompletionChunk(id=response_id, created=job.created, model=model, choices=[choice]).model_dump_json()
    assert event_json(job.chat_chunk(index, c)) == json.loads(want)
