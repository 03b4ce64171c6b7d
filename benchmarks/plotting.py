"""What the ``plot_*.py`` scripts share: matplotlib without a display, and saving a figure where asked.

Needs matplotlib (not a dependency of any package). The scripts run as ``python benchmarks/plot_X.py``, which
puts this folder first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
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


def labelled_results(argv: list[str] | None, default_title: str) -> tuple[argparse.Namespace, list[tuple[str, Any]]]:
    """Parse ``LABEL=FILE ... --out PNG [--title T]`` and load each FILE's JSON: ``(args, [(label, result)])``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+", help="LABEL=FILE")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default=default_title)
    args = parser.parse_args(argv)
    pairs = [item.rsplit("=", 1) for item in args.results]
    return args, [(label, json.loads(Path(path).read_text())) for label, path in pairs]
