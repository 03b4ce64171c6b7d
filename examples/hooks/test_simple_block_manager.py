from nanovllm_testing.conformance import BlockManagerConformance
from simple_block_manager import SimpleBlockManager


class TestSimpleBlockManager(BlockManagerConformance):
    block_manager_cls = SimpleBlockManager
    supports_prefix_caching = False
