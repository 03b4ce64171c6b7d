"""LLM: the offline batch API (vLLM's ``LLM.generate``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from nanovllm_core.engine.llm_engine import LLMEngine, Prompt
from nanovllm_core.errors import InvalidRequestError
from nanovllm_core.outputs import CompletionOutput, RequestOutput
from nanovllm_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM(LLMEngine):
    """``LLM(model, config="nanovllm.toml", **overrides).generate(prompts, sampling_params)``."""

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``.

        A prompt that cannot be served (empty, too long, token ids outside the vocabulary) gets an output
        with ``error`` set and ``finish_reason="error"``; the other prompts still complete.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SequenceABC) and len(sampling_params) == len(prompts):
            params_list = list(sampling_params)
        else:
            raise InvalidRequestError(
                f"sampling_params must be one SamplingParams or a list with one per prompt ({len(prompts)} prompts)"
            )
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = f"generate-{id(self)}-{i}-{len(self._requests)}"
            try:
                self.add_request(prompt, params, request_id=request_id)
            except InvalidRequestError as exc:
                logger.warning("prompt %d rejected: %s", i, exc)
                results[request_id] = RequestOutput(
                    request_id=request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=list(prompt) if isinstance(prompt, list) else [],
                    outputs=[CompletionOutput(0, "", [], "error")],
                    finished=True,
                    error=str(exc),
                )
            order.append(request_id)
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        bar.update(len(results))
        try:
            while self.has_unfinished_requests():
                finished = self.step()
                if use_tqdm:
                    bar.set_postfix_str(self.stats.rates_text(), refresh=False)
                for out in finished:
                    results[out.request_id] = out
                    bar.update(1)
        except BaseException:
            for request_id in order:  # leave the engine clean for the next call
                if request_id not in results:
                    self.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [results[r] for r in order]
