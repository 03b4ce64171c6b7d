"""``python -m nanovllm_core.cli``: the ``nanovllm`` command."""

import sys

from nanovllm_core.cli import main

sys.exit(main())
