"""The attention backend kit: :class:`AttentionBackendConformance` and its reference, :func:`dense_attention`."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from nanovllm_core.engine.cuda_graph import MixedStepBuffers
from nanovllm_core.interfaces import AttentionBackend, AttentionBatch
from nanovllm_core.plugins import check_registration
from nanovllm_testing.conformance._shared import parametrize


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention in float64 of queries at positions ``start...`` over keys/values ``[0, end)``."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class AttentionBackendConformance:
    """Checks an :class:`~nanovllm_core.AttentionBackend`; set ``backend_cls`` in a ``Test...`` subclass.

    Three steps over six sequences of a paged cache with shuffled blocks and two layers: prompts only, then
    prompt chunks over cached context beside decode tokens and a new prompt, then decode only. Every output
    is compared with :func:`dense_attention`; a backend with ``supports_cuda_graph_mixed`` runs the steps with
    prompt tokens a second time through a CUDA graph's padded static batch. Skipped where ``check_available``
    says the backend cannot run.
    """

    backend_cls: ClassVar[type[AttentionBackend]]
    backend_options: ClassVar[dict[str, Any]] = {}
    device: ClassVar[str] = "cpu"
    dtype: ClassVar[torch.dtype] = torch.float32
    head_dim: ClassVar[int] = 128
    block_size: ClassVar[int | None] = None  # None: the first supported size, or 16
    atol: ClassVar[float] = 1e-4
    rtol: ClassVar[float] = 1e-4

    def _setup(self) -> tuple[torch.device, int]:
        import pytest
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        device = torch.device(self.device)
        reason = self.backend_cls.check_available(device, self.dtype, self.head_dim)
        if reason is not None:
            pytest.skip(f"{self.backend_cls.__name__} is not available here: {reason}")
        sizes = self.backend_cls.supported_block_sizes()
        return device, self.block_size or (sizes[0] if sizes else 16)

    def test_is_an_attention_backend(self) -> None:
        problem = check_registration("attention", self.backend_cls)
        assert problem is None, problem
        assert isinstance(self.backend_cls.name, str) and self.backend_cls.name, "set the class attribute `name`"

    def test_supported_block_sizes_are_valid(self) -> None:
        sizes = self.backend_cls.supported_block_sizes()
        if sizes is not None:
            assert sizes and all(16 <= s <= 256 and s & (s - 1) == 0 for s in sizes), (
                f"supported_block_sizes() = {sizes}: the config allows powers of two from 16 to 256"
            )

    @parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
    def test_ragged_batches_match_dense_attention(self, num_heads: int, num_kv_heads: int) -> None:
        self._check_ragged_batches(num_heads, num_kv_heads, graph_buffers=False)

    @parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
    def test_graph_batches_match_dense_attention(self, num_heads: int, num_kv_heads: int) -> None:
        """Backends with ``supports_cuda_graph_mixed``: the steps with prompt tokens go through the static batch
        a captured graph replays (``MixedStepBuffers``: padding rows, tokens owned by no sequence holding NaN,
        metadata from ``build_graph_metadata``), as the model runner's graphs do."""
        import pytest
        if not self.backend_cls.supports_cuda_graph_mixed:
            pytest.skip(f"{self.backend_cls.__name__} does not capture steps with prompt tokens")
        self._check_ragged_batches(num_heads, num_kv_heads, graph_buffers=True)

    def _check_ragged_batches(self, num_heads: int, num_kv_heads: int, graph_buffers: bool) -> None:
        device, bs = self._setup()
        d, dtype, num_layers = self.head_dim, self.dtype, 2
        # Positions that each sequence has computed after steps 0, 1, 2, 3.
        plans = [
            (0, bs + 4, bs + 5, bs + 6),  # prompt, then decode tokens
            (0, 5, 12, 13),  # short prompt, chunk in the same block, decode
            (0, 2 * bs + 1, 2 * bs + 2, 2 * bs + 3),  # prompt over three blocks, decodes
            (0, bs, 2 * bs + 4, 2 * bs + 5),  # chunk ending on a block boundary, chunk across blocks
            (0, 0, 3, 4),  # arrives in the second step
            (0, 1, 2, 3),  # one-token prompt
        ]
        gen = torch.Generator().manual_seed(0)
        lengths = [plan[-1] for plan in plans]
        num_blocks = sum(-(-n // bs) for n in lengths) + 3
        free = torch.randperm(num_blocks, generator=gen).tolist()
        tables = []
        for n in lengths:
            tables.append(free[: -(-n // bs)])
            free = free[-(-n // bs) :]

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)  # rounded to dtype once: the reference sees the same

        q = [[rand(n, num_heads, d) for n in lengths] for _ in range(num_layers)]
        k = [[rand(n, num_kv_heads, d) for n in lengths] for _ in range(num_layers)]
        v = [[rand(n, num_kv_heads, d) for n in lengths] for _ in range(num_layers)]
        shape = self.backend_cls.kv_cache_shape(num_blocks, bs, num_kv_heads, d)
        caches = [(torch.randn(*shape, generator=gen) * 3).to(device=device, dtype=dtype) for _ in range(num_layers)]
        scale = d**-0.5
        backend = self.backend_cls(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=d, scale=scale, block_size=bs, dtype=dtype,
            device=device, **self.backend_options,
        )
        step_tokens = [sum(plan[step + 1] - plan[step] for plan in plans) for step in range(3)]
        buffers = MixedStepBuffers(len(plans) + 2, max(step_tokens) + 5, max(lengths) + bs, bs, device)
        for step in range(3):
            rows = [(i, plan[step], plan[step + 1]) for i, plan in enumerate(plans) if plan[step + 1] > plan[step]]
            batch = AttentionBatch.from_spans([tables[i] for i, _, _ in rows], [(s, e) for _, s, e in rows], bs, device)
            padded = graph_buffers and buffers.can_run(batch)
            if padded:
                no_ids = torch.zeros(batch.num_tokens, dtype=torch.int64, device=device)
                size = buffers.load(no_ids, no_ids, batch)
                metadata = backend.build_graph_metadata(buffers.bucket(size))
            else:
                metadata = backend.build_metadata(batch)
            for layer in range(num_layers):
                qs, ks, vs = ([x[layer][i][s:e] for i, s, e in rows] for x in (q, k, v))
                qkv = [torch.cat(x).to(device) for x in (qs, ks, vs)]
                if padded:  # the bucket's tokens past the step's: owned by no sequence, never stored or read
                    qkv = [torch.cat([x, x.new_full((size - len(x), *x.shape[1:]), torch.nan)]) for x in qkv]
                out = backend.forward(*qkv, caches[layer], metadata)
                if padded:
                    out = out[: batch.num_tokens]
                assert out.shape == (batch.num_tokens, num_heads, d), f"output shape {tuple(out.shape)}"
                offset = 0
                for i, s, e in rows:
                    ref = dense_attention(q[layer][i][s:e], k[layer][i][:e], v[layer][i][:e], s, scale)
                    got = out[offset : offset + e - s].double().cpu()
                    offset += e - s
                    torch.testing.assert_close(
                        got, ref, atol=self.atol, rtol=self.rtol,
                        msg=lambda m, i=i, s=s, e=e, step=step, layer=layer: (
                            f"step {step}, layer {layer}, sequence {i}: queries at positions [{s}, {e}) over "
                            f"{e} tokens of context ({s} cached): {m}"
                        ),
                    )
