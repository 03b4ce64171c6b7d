"""GPU check of min_tokens, logit_bias and allowed_token_ids (benchmarks/gpu_session.sh r12-d): the tiny checkpoint
on CUDA, greedy and seeded sampling, beside a plain greedy request; exits non-zero on a failed check."""

import pathlib
import tempfile

from nanovllm_core import LLM, SamplingParams
from nanovllm_core.testing.checkpoints import write_tiny_checkpoint


def greedy(**options) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, **options)


def main() -> None:
    path = write_tiny_checkpoint(pathlib.Path(tempfile.mkdtemp()), "qwen3")
    llm = LLM(str(path), device="cuda", kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=64)
    prompt = [10, 11, 12]
    plain = llm.generate([prompt], greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    allowed = [plain[2], 300, 301, 200]
    params = [
        greedy(ignore_eos=True, allowed_token_ids=allowed),
        greedy(ignore_eos=True, logit_bias={plain[0]: -100, 77: 100}),
        greedy(stop_token_ids=[plain[1]], min_tokens=6),
        greedy(ignore_eos=True),
    ]
    tokens = [o.outputs[0].token_ids for o in llm.generate([prompt] * 4, params, use_tqdm=False)]
    assert set(tokens[0]) <= set(allowed), tokens[0]
    assert tokens[1] == [77] * 12, tokens[1]
    assert plain[1] not in tokens[2][:6] and len(tokens[2]) >= 6, tokens[2]
    assert tokens[3] == plain, (tokens[3], plain)
    sampled = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed, seed=1)
    outs = llm.generate([prompt] * 2, [sampled] * 2, use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
    print("GPU logit adjustments: every check passed", tokens)


if __name__ == "__main__":
    main()
