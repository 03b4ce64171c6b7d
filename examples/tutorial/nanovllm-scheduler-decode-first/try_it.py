"""Print how many prompt and decode tokens each step computes while requests come and go."""

from nanovllm_core import LLMEngine, SamplingParams

engine = LLMEngine(config="nanovllm.toml")
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
engine.add_request("0", "The quick brown fox jumps over the lazy dog.", params)
step = 0
while engine.has_unfinished_requests():
    if step == 2:  # two long prompts arrive while the first request is decoding
        engine.add_request("1", "To be or not to be, that is the question. " * 3, params)
        engine.add_request("2", "All that glitters is not gold. " * 4, params)
    finished = engine.step()
    step += 1
    counts = engine.step_stats
    print(f"step {step}: {counts.num_prefill_tokens} prompt + {counts.num_decode_tokens} decode tokens")
    for out in finished:
        print(f"  request {out.request_id} finished: {out.outputs[0].token_ids}")
