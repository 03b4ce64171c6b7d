"""Run pytest in an environment without the model and attention plugins and the measuring tools.

The core's unit tests (``tests/unit``) must pass with only ``nanovllm-core`` and the ``fifo`` scheduler plugin
installed. This builds a throw-away virtual environment whose site-packages links to every entry of this one's
except the three distributions below (their packages, metadata and editable-install hooks), so they can be
neither imported nor found through entry points, checks that, and runs pytest there with the given arguments
from the repository root:

    .venv/bin/python tests/run_without_plugins.py tests/unit -q
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tempfile
import venv
from pathlib import Path

# as they appear in site-packages entry names
HIDDEN = ("nanovllm_models_qwen3", "nanovllm_attention_flash", "nanovllm_bench")
ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import importlib.metadata, importlib.util, sys
hidden = {hidden!r}
left = [n for n in hidden if importlib.util.find_spec(n) is not None]
left += [d.metadata["Name"] for d in importlib.metadata.distributions()
         if d.metadata["Name"].replace("-", "_").lower() in hidden]
sys.exit(f"still installed: {{left}}" if left else 0)
"""


def site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.check_output([str(python), "-c", code], text=True).strip())


def main(argv: list[str]) -> int:
    source = Path(sysconfig.get_paths()["purelib"])
    with tempfile.TemporaryDirectory(prefix="nanovllm-without-plugins-") as tmp:
        venv.EnvBuilder(symlinks=True, with_pip=False).create(tmp)
        python = Path(tmp) / "bin" / "python"
        target = site_packages(python)
        for entry in source.iterdir():
            if not any(name in entry.name for name in HIDDEN):
                (target / entry.name).symlink_to(entry)
        subprocess.run([str(python), "-c", CHECK.format(hidden=HIDDEN)], cwd=ROOT, check=True)
        return subprocess.call([str(python), "-m", "pytest", *argv], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
