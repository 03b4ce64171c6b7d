"""Where a data-parallel client sends each new request: the least loaded replica, unless another one holds the
request's prompt prefix in its prefix cache (cache-aware routing, as SGLang's router does it).

The router keeps, per replica, the hashes of the prompt prefixes it sent there (fixed-size chunks, each hash
chained to the one before it, so a hash stands for the whole prefix up to its chunk's end): an approximation of
what that replica's prefix cache holds, bounded per replica and forgotten least recently used first. A request
goes to the replica that matches the most of its leading chunks unless that replica is overloaded (its load more
than ``balance_abs_tokens`` above the least loaded one's and more than ``balance_rel`` times it); then, and when
nothing matches, to the least loaded replica. Loads are outstanding tokens, kept by the client in :attr:`loads`.
``policy`` ``"least_loaded"`` leaves the prefixes out, and ``"round_robin"`` the loads as well (to compare with:
benchmarks/routing.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

POLICIES = ("cache_aware", "least_loaded", "round_robin")
CHARS_PER_TOKEN = 4  # a text prompt's chunks: about as many characters as a chunk of tokens takes


class Router:
    """Picks a replica for each new request (:meth:`route`); ``loads[r]`` is replica r's outstanding work in
    tokens, which its owner keeps up to date."""

    def __init__(
        self,
        num_replicas: int,
        chunk_tokens: int = 16,
        *,
        policy: str = "cache_aware",
        balance_abs_tokens: int = 4096,
        balance_rel: float = 1.5,
        max_chunks_per_replica: int = 1 << 16,
    ) -> None:
        if num_replicas < 1 or chunk_tokens < 1:
            raise ValueError(
                f"a router needs num_replicas >= 1 and chunk_tokens >= 1, not {num_replicas} and {chunk_tokens}"
            )
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r} is unknown; choose from {', '.join(POLICIES)}")
        self.loads = [0] * num_replicas
        self.chunk_tokens = chunk_tokens
        self.policy = policy
        self._turn = 0  # round robin: the replica after the last one chosen
        self.balance_abs_tokens = balance_abs_tokens
        self.balance_rel = balance_rel
        self.max_chunks = max_chunks_per_replica
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def chunk_hashes(self, prompt: Any) -> list[int]:
        """Chained hashes of the prompt's full chunks: ``chunk_tokens`` token ids, or ``CHARS_PER_TOKEN`` times as
        many characters of a text prompt; none for anything else."""
        if isinstance(prompt, str):
            size, key = self.chunk_tokens * CHARS_PER_TOKEN, "text"
        elif isinstance(prompt, (list, tuple)):
            size, key = self.chunk_tokens, "ids"
        else:
            return []
        hashes, previous = [], hash(key)
        for end in range(size, len(prompt) + 1, size):
            previous = hash((previous, tuple(prompt[end - size : end])))
            hashes.append(previous)
        return hashes

    def matched_chunks(self, replica: int, hashes: list[int]) -> int:
        """How many of the leading chunks replica ``replica`` was sent before (and has not forgotten)."""
        cached = self._cached[replica]
        matched = 0
        for h in hashes:
            if h not in cached:
                break
            matched += 1
        return matched

    def route(self, prompt: Any, up: list[bool] | None = None) -> int:
        """The replica for a new request (among those ``up``), remembered as holding its prompt's prefix."""
        loads = self.loads
        candidates = [r for r in range(len(loads)) if up is None or up[r]]
        if not candidates:
            raise RuntimeError("no data-parallel replica is serving: every one is down")
        if self.policy == "round_robin":
            chosen = next((r for r in candidates if r >= self._turn), candidates[0])
            self._turn = chosen + 1
            return chosen
        least = self.least_loaded(up)
        hashes = self.chunk_hashes(prompt) if self.policy == "cache_aware" else []
        chosen, matched = least, 0
        for r in candidates:
            m = self.matched_chunks(r, hashes) if hashes else 0
            if m > matched or (m == matched and m > 0 and loads[r] < loads[chosen]):
                chosen, matched = r, m
        if matched and self.overloaded(loads[chosen], loads[least]):
            chosen = least
        self._remember(chosen, hashes)
        return chosen

    def least_loaded(self, up: list[bool] | None = None) -> int:
        """The replica (among those ``up``) with the least outstanding work; 0 when none is up."""
        candidates = [r for r in range(len(self.loads)) if up is None or up[r]]
        return min(candidates, key=self.loads.__getitem__) if candidates else 0

    def overloaded(self, load: int, least: int) -> bool:
        return load - least > self.balance_abs_tokens and load > self.balance_rel * least

    def _remember(self, replica: int, hashes: list[int]) -> None:
        cached = self._cached[replica]
        for h in hashes:
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.max_chunks:
            cached.popitem(last=False)

    def forget(self, replica: int) -> None:
        """Replica ``replica`` lost its cache (it restarted): nothing is routed to it for affinity any more."""
        self._cached[replica].clear()
