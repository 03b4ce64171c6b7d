"""OutputProcessor on hand-made engine-core outputs: stop strings (a match finishes the sample, asks for its abort,
or the request's once every sample is done, and drops what the core produced after it), output kinds, and the two
incremental detokenizers giving the same text."""

from __future__ import annotations

import logging
import random

import pytest
from nanovllm_testing.checkpoints import build_tokenizer

from nanovllm_core.engine_client import base
from nanovllm_core.output_processor import (
    DecodeStream,
    IncrementalDetokenizer,
    OutputProcessor,
    decoder_of,
    engine_params,
)
from nanovllm_core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanovllm_core.sampling_params import SamplingParams

TOKENIZER = build_tokenizer()


def ids_of(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def raw(request_id: str, pieces: dict[int, list[int]], finish: dict[int, str] | None = None) -> RequestOutput:
    """An engine-core output: token ids per sample index, no text; finished when every sample has a reason."""
    finish = finish or {}
    outputs = [CompletionOutput(i, "", ids, finish.get(i)) for i, ids in pieces.items()]
    return RequestOutput(request_id, None, [1, 2], outputs, finished=bool(finish) and len(finish) == len(pieces))


def feed(processor: OutputProcessor, request_id: str, token_ids: list[int], index: int = 0) -> list:
    """One core output per token (as the core sends deltas); the user's outputs and the ids to abort, per step."""
    return [processor.process_outputs([raw(request_id, {index: [t]})]) for t in token_ids]


def test_decode_stream_and_incremental_detokenizer_give_the_same_text():
    rng = random.Random(0)
    words = ids_of("the quick brown fox jumps over the lazy dog, then naïve café résumé ☃ again")
    decode = decoder_of(TOKENIZER)
    for _ in range(20):
        # words, byte pieces (characters split across tokens) and ids the tokenizer does not know
        ids = [rng.choice([rng.choice(words), rng.randrange(384), rng.randrange(384, 2000)]) for _ in range(120)]
        python, rust = IncrementalDetokenizer(decode, 0, True), DecodeStream(TOKENIZER.backend_tokenizer, True)
        for end in range(1, len(ids) + 1):
            python.update(ids[:end])
            rust.update(ids[:end])
            assert rust.text == python.text


def test_a_stop_string_finishes_the_request_and_drops_what_follows():
    processor = OutputProcessor(TOKENIZER)
    params = SamplingParams(max_tokens=50, stop=["fox"])
    assert engine_params(params).output_kind == "delta"  # the core sends every token to match them here
    processor.add("r", params)
    ids = ids_of("the quick brown fox jumps over")
    steps = feed(processor, "r", ids)
    finished = [i for i, (outs, _) in enumerate(steps) if outs]
    assert len(finished) == 1  # output_kind "final": one output, when the stop string matched
    outs, to_abort = steps[finished[0]]
    assert to_abort == [("r", None)]  # the whole request
    out = outs[0].outputs[0]
    assert out.text == "the quick brown " and (out.finish_reason, out.stop_reason) == ("stop", "fox")
    assert TOKENIZER.decode(out.token_ids).endswith("fox") and out.token_ids == ids[: len(out.token_ids)]
    assert all(outs == [] and aborts == [] for outs, aborts in steps[finished[0] + 1 :])
    # the core's answer to the abort ends the request there; an id used again afterwards is a new request
    assert processor.process_outputs([raw("r", {0: []}, {0: "abort"})]) == ([], [])
    processor.add("r", SamplingParams(max_tokens=1))
    outs, _ = processor.process_outputs([raw("r", {0: ids[:1]}, {0: "length"})])
    assert outs[0].outputs[0].token_ids == ids[:1] and outs[0].outputs[0].finish_reason == "length"


def test_a_stop_ended_output_without_metrics_waits_for_the_cores_final_one_and_counts_to_the_match():
    """Streamed outputs of an engine process come without metrics: the stop-finished output is held until the core's
    final output (the abort's) brings them, less the tokens the core produced after the match, finished at the match
    (the time the engine handed the matching output over)."""
    processor = OutputProcessor(TOKENIZER, hold_for_metrics=True)
    processor.add("r", SamplingParams(max_tokens=50, stop=["fox"]))
    ids = ids_of("the quick brown fox jumps over")
    steps = [processor.process_outputs([raw("r", {0: [t]})], now=10.0 + k) for k, t in enumerate(ids)]
    assert all(outs == [] for outs, _ in steps)
    match = next(k for k, (_, aborts) in enumerate(steps) if aborts == [("r", None)])
    assert processor.holds("r") and match < len(ids) - 1  # the core ran on after the match
    final = raw("r", {0: []}, {0: "abort"})
    final.metrics = RequestMetrics(9.0, 9.5, 10.0, 10.0 + len(ids) - 1, None, 2, 0, len(ids))
    outs, to_abort = processor.process_outputs([final], now=99.0)
    assert to_abort == [] and not processor.holds("r") and len(outs) == 1
    out, m = outs[0], outs[0].metrics
    assert out.finished and out.outputs[0].token_ids == ids[: match + 1] and out.outputs[0].stop_reason == "fox"
    assert m.num_generation_tokens == match + 1 and m.last_token_time == m.finished_time == 10.0 + match
    assert (m.arrival_time, m.first_token_time, m.num_prompt_tokens) == (9.0, 10.0, 2)


def test_a_held_output_released_without_metrics_drops_what_the_core_sends_later():
    processor = OutputProcessor(TOKENIZER, hold_for_metrics=True)
    processor.add("r", SamplingParams(max_tokens=50, stop=["fox"]))
    feed(processor, "r", ids_of("the quick brown fox"))
    out = processor.release("r")
    assert out is not None and out.finished and out.metrics is None and not processor.holds("r")
    assert processor.release("r") is None
    assert processor.process_outputs([raw("r", {0: []}, {0: "abort"})]) == ([], [])


class StreamingEngines(base.EngineClient):
    """A push client whose engine streams ``token_ids`` one output per step without metrics, as an engine process
    does, and answers an abort with a final output with metrics (``answers_aborts``) or not at all."""

    tokenizer = TOKENIZER
    alive = True

    def __init__(self, token_ids: list[int], answers_aborts: bool) -> None:
        self.token_ids, self.answers_aborts = token_ids, answers_aborts

    def start(self, emit, fail, loop=None) -> None:
        self.emit = emit

    def submit(self, commands) -> None:
        for call_id, kind, args in commands:
            if kind == "add":
                self.emit([(call_id, None, None)], [], 0.0, None)
                for k, t in enumerate(self.token_ids):
                    self.emit([], [raw(args[2], {0: [t]})], 10.0 + k, None)
            elif kind == "abort" and self.answers_aborts:
                final = raw(args[0], {0: []}, {0: "abort"})
                final.metrics = RequestMetrics(9.0, 9.5, 10.0, 10.0 + len(self.token_ids) - 1, None, 2, 0, 99)
                self.emit([], [final], 99.0, None)

    def join(self) -> None:
        pass


@pytest.mark.parametrize("answers_aborts", [True, False])
def test_the_pull_side_waits_bounded_for_the_aborts_metrics(answers_aborts, monkeypatch, caplog):
    monkeypatch.setattr(base, "ABORT_WAIT_S", 0.2)
    ids = ids_of("the quick brown fox jumps over")
    client = StreamingEngines(ids, answers_aborts)
    client.add_request("hi", SamplingParams(max_tokens=50, stop=["fox"]), "r")
    with caplog.at_level(logging.WARNING, logger=base.__name__):
        out = client.step()[0]
    assert out.finished and out.outputs[0].stop_reason == "fox" and not client.has_unfinished_requests()
    late = len(ids) - len(out.outputs[0].token_ids)
    if answers_aborts:
        assert out.metrics.num_generation_tokens == 99 - late and not caplog.records
    else:
        assert out.metrics is None and "its abort brought no metrics" in caplog.text


def test_streamed_text_holds_back_a_possible_stop_string_and_can_include_it():
    processor = OutputProcessor(TOKENIZER)
    for include in (False, True):
        params = SamplingParams(
            max_tokens=50, stop=["lazy dog"], output_kind="delta", include_stop_str_in_output=include
        )
        processor.add(f"r{include}", params)
        steps = feed(processor, f"r{include}", ids_of("over the lazy dog again"))
        pieces = [outs[0].outputs[0] for outs, _ in steps if outs]
        text = "".join(p.text for p in pieces)
        assert text == ("over the lazy dog" if include else "over the ")
        assert pieces[-1].finish_reason == "stop"


def test_with_n_samples_a_stopped_sample_is_aborted_alone_and_the_core_finishes_the_rest():
    processor = OutputProcessor(TOKENIZER)
    processor.add("r", SamplingParams(n=2, max_tokens=50, stop=["brown"], output_kind="delta"))
    stopping, going = ids_of("a brown cat"), ids_of("a white cat and more")
    aborts = []
    for a, b in zip(stopping, going):
        outs, to_abort = processor.process_outputs([raw("r", {0: [a], 1: [b]})])
        aborts += to_abort
        assert all(c.finish_reason is None or c.index == 0 for o in outs for c in o.outputs)
    assert aborts == [("r", (0,))]  # sample 0 alone: sample 1 still runs
    outs, to_abort = processor.process_outputs([raw("r", {0: [7], 1: [going[-1]]}, {0: "length", 1: "stop"})])
    assert to_abort == [] and outs[0].finished  # the core finished it: nothing to abort
    assert [c.finish_reason for c in outs[0].outputs] == ["stop", "stop"] and outs[0].outputs[0].stop_reason == "brown"


def test_with_n_samples_the_last_sample_a_stop_string_finishes_aborts_the_whole_request():
    processor = OutputProcessor(TOKENIZER)
    processor.add("r", SamplingParams(n=2, max_tokens=50, stop=["brown", "white"], output_kind="delta"))
    first, second = ids_of("a brown cat"), ids_of("the small white")
    aborts = [processor.process_outputs([raw("r", {0: [a], 1: [b]})])[1] for a, b in zip(first, second)]
    at = len(ids_of("a brown")) - 1
    assert aborts[at] == [("r", (0,))] and all(a == [] for a in aborts[:at])
    # what the core produced for sample 0 before its abort reached it is dropped; sample 1's stop ends the request
    rest = second[len(first) :]
    steps = [processor.process_outputs([raw("r", {0: [5], 1: [b]})]) for b in rest]
    assert [to_abort for _, to_abort in steps] == [[]] * (len(rest) - 1) + [[("r", None)]]
    out = steps[-1][0][0]
    assert out.finished
    assert [(c.finish_reason, c.stop_reason) for c in out.outputs] == [("stop", "brown"), ("stop", "white")]
    assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""  # delta: sample 0 had said all it had


def test_logprob_tokens_are_decoded_and_cumulative_outputs_hold_everything():
    processor = OutputProcessor(TOKENIZER)
    processor.add("r", SamplingParams(max_tokens=3, logprobs=1, output_kind="cumulative"))
    assert engine_params(processor.requests["r"].params).output_kind == "delta"
    ids = ids_of("the fox")
    seen = []
    for k, t in enumerate(ids):
        position = {t: Logprob(-0.5, 1)}
        out = RequestOutput("r", None, [1], [CompletionOutput(0, "", [t], None, None, None, [position])], False)
        seen.append(processor.process_outputs([out])[0][0].outputs[0])
        assert seen[-1].token_ids == ids[: k + 1]
    assert seen[-1].logprobs[0][ids[0]].decoded_token == TOKENIZER.decode([ids[0]])
    assert seen[-1].cumulative_logprob == -0.5 * len(ids)


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_a_plain_stream_gives_what_the_general_path_gives(backend):
    """A streamed request with one sample and neither stop strings nor logprobs takes process()'s short path: the
    same outputs, token for token, as the general path, through byte pieces and unknown ids, to the final one."""
    rng = random.Random(1)
    words = ids_of("naïve café résumé ☃ the quick brown fox")
    params = SamplingParams(max_tokens=100, output_kind="delta")
    for trial in range(10):
        ids = [rng.choice([rng.choice(words), rng.randrange(384), rng.randrange(384, 2000)]) for _ in range(60)]
        chunks, at = [], 0
        while at < len(ids):  # mostly one token a step, some steps several (a consumer that fell behind)
            size = rng.choice([1, 1, 1, 3])
            chunks.append(ids[at : at + size])
            at += size
        got = []
        for short in (True, False):
            processor = OutputProcessor(TOKENIZER)
            if backend == "python":
                processor._backend = None
            state = processor.new_request(params, prompt="p", prompt_token_ids=[1, 2])
            assert state.plain_stream
            state.plain_stream = short
            outs = [processor.process(state, raw("r", {0: chunk})) for chunk in chunks]
            outs.append(processor.process(state, raw("r", {0: [ids[0]]}, {0: "length"})))
            got.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason, o.finished, o.prompt)
                        for o in outs])  # fmt: skip
        assert got[0] == got[1], f"trial {trial}"
