from simple_block_manager import SimpleBlockManager

from nanovllm_core.testing.conformance import BlockManagerConformance


class TestSimpleBlockManager(BlockManagerConformance):
    block_manager_cls = SimpleBlockManager
    supports_prefix_caching = False
