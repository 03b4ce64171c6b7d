"""``prefix_cache``: ref-counted KV blocks whose full blocks are found again by a chained xxhash."""

from __future__ import annotations

from array import array

import xxhash

from nanovllm_core import BlockManager, Sequence


def chain_hash(previous: int, token_ids: list[int]) -> int:
    """Hash of a full block given the hash of the block before it (-1 for the first)."""
    h = xxhash.xxh64()
    h.update(previous.to_bytes(8, "little", signed=True))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest() - (1 << 63)  # signed 64-bit, so that -1 never collides by construction


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: tuple[int, ...] = ()


class PrefixCachingBlockManager(BlockManager):
    """Blocks are shared between sequences whose prompts start with the same full blocks of tokens.

    Free blocks keep their hash and contents until they are handed out again, so a prefix that was
    used before stays findable; the least recently freed block is reused first, and a sequence's tail
    blocks are freed before its head, so common prefixes live longest. Several blocks may hold the same
    prefix (sequences admitted in the same step each compute their own copy): every copy stays findable
    until it is handed out, and a lookup prefers a copy in use, which costs no free block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))  # ordered: LRU first
        self.hash_to_block_ids: dict[int, list[int]] = {}  # every block holding that hash, in use or free
        self._num_hashed_blocks: dict[int, int] = {}  # seq_id -> leading blocks already made findable
        self._block_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its leading full blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    # --- hashing --------------------------------------------------------------------------------------

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        hashes = self._block_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else -1, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def _cached_block_ids(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return []
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs  # the last token is always computed
        found = []
        for i, h in enumerate(self._hashes(seq, limit)):
            block_id = self._find(h, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            if block_id is None:
                break
            found.append(block_id)
        return found

    def _find(self, h: int, token_ids: tuple[int, ...]) -> int | None:
        """A block holding ``token_ids`` under hash ``h``: one in use if there is one, else a free one."""
        found = None
        for block_id in self.hash_to_block_ids.get(h, ()):
            block = self.blocks[block_id]
            if block.token_ids == token_ids:  # a hash collision must not hand out other tokens' KV
                if block.ref_count:
                    return block_id
                if found is None:
                    found = block_id
        return found

    def num_cached_tokens(self, seq: Sequence) -> int:
        return len(self._cached_block_ids(seq)) * self.block_size

    # --- allocation -----------------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        block_id = next(iter(self.free_block_ids))
        del self.free_block_ids[block_id]
        block = self.blocks[block_id]
        if block.hash != -1:
            copies = self.hash_to_block_ids[block.hash]
            if len(copies) == 1:
                del self.hash_to_block_ids[block.hash]
            else:
                copies.remove(block_id)
            block.hash, block.token_ids = -1, ()
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        table = seq.block_table
        if table:
            # the hot path of every decode step: plain arithmetic, no helper calls
            needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
            if needed <= 0:
                return True
            if needed > len(self.free_block_ids):
                return False
            for _ in range(needed):
                table.append(self._take_free_block())
            return True
        cached = self._cached_block_ids(seq)
        total = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        num_cached_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        if total - len(cached) + num_cached_free > len(self.free_block_ids):
            return False
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            table.append(block_id)
        for _ in range(total - len(cached)):
            table.append(self._take_free_block())
        seq.num_computed_tokens = max(seq.num_computed_tokens, len(cached) * self.block_size)
        return True

    def allocate_many(self, seqs: list[Sequence], num_new_tokens: list[int]) -> bool:
        bs = self.block_size
        growing = [  # a sequence grows when its tokens pass its blocks' capacity: the block count only for those
            (seq.block_table, -(-end // bs) - len(seq.block_table))
            for seq, n in zip(seqs, num_new_tokens)
            if (end := seq.num_computed_tokens + n) > len(seq.block_table) * bs
        ]
        if sum(needed for _, needed in growing) > len(self.free_block_ids):
            return False
        for table, needed in growing:  # in order: the blocks that one allocate call per sequence would take
            for _ in range(needed):
                table.append(self._take_free_block())
        return True

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        self._num_hashed_blocks.pop(seq.seq_id, None)
        self._block_hashes.pop(seq.seq_id, None)

    def cache_full_blocks(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        done = self._num_hashed_blocks.get(seq.seq_id, 0)
        if num_full <= done:
            return
        self._num_hashed_blocks[seq.seq_id] = num_full
        hashes = self._hashes(seq, num_full)
        for i in range(done, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash != -1:
                continue
            block.hash = hashes[i]
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            copies = self.hash_to_block_ids.get(block.hash)
            if copies is None:
                self.hash_to_block_ids[block.hash] = [block.block_id]
            else:
                copies.append(block.block_id)
