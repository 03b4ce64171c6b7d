"""``simple``: a block manager without prefix caching. Each sequence gets blocks of its own."""

from nanovllm_core import BlockManager, Sequence, hookimpl

NANOVLLM_PLUGIN_API = ">=2,<3"


class SimpleBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.free_ids = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def num_cached_tokens(self, seq: Sequence) -> int:
        return 0  # no prefix cache

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > len(self.free_ids):
            return False  # all or nothing
        for _ in range(needed):
            seq.block_table.append(self.free_ids.pop())
        return True

    def free(self, seq: Sequence) -> None:
        self.free_ids.extend(reversed(seq.block_table))
        seq.block_table = []


@hookimpl
def nanovllm_register_block_managers(register):
    register("simple", SimpleBlockManager)
