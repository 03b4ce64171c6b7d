"""What the ``plot_*.py`` scripts share: matplotlib without a display, and saving a figure where asked.

Needs matplotlib (not a dependency of any package). The scripts run as ``python benchmarks/plot_X.py``, which
puts this folder first on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402, F401 - re-exported for the scripts


def save(fig: Any, out: str | Path, dpi: int) -> None:
    """Lay ``fig`` out, write it to ``out`` (its folder made if missing) and say so."""
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    print(f"wrote {out}")
