"""The README's two commands in a fresh checkout: the repository's files copied into an empty folder (what
``git clone`` gives, plus this working tree's uncommitted files), ``make run``, then ``make test`` collecting
every test. Each makes its own virtualenv from the lock (``constraints.txt``), as on a new machine; packages
come from the index or pip's cache. Collecting imports every test module, which is where a module of the
checkout shadowing an installed package, or a missing optional dependency, first fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def checkout_files() -> list[str]:
    if shutil.which("git") is None or shutil.which("make") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git, make and a git checkout")
    done = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [name for name in done.stdout.split("\0") if name and (ROOT / name).is_file()]


def clean_env(folder: Path) -> dict[str, str]:
    """This process's environment without what points at its virtualenv or configures its pytest and pip."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTEST_ADDOPTS", "PIP_CONSTRAINT", "MAKEFLAGS", "MAKELEVEL", "MFLAGS"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    ours = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != ours)
    env["NANOVLLM_CACHE"] = str(folder / "cache")
    return env


def run_demo(checkout: Path, env: dict[str, str]) -> None:
    run = subprocess.run(["make", "run"], cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("--- prompt:") == 3 and "(32 tokens, length)" in run.stdout, run.stdout[-3000:]


def test_the_readme_commands_work_in_a_fresh_checkout(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme, "the README's development commands changed"
    if os.environ.get("NANOVLLM_FRESH_CLONE") == "1":
        # .ci/run: this checkout is itself a fresh clone, whose `make test` built its virtualenv from the lock and
        # is collecting and running every test now; what is left to check is `make run` on that virtualenv
        run_demo(ROOT, clean_env(tmp_path))
        return
    checkout = tmp_path / "checkout"
    for name in checkout_files():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, checkout / name)
    env = clean_env(tmp_path)
    try:
        run_demo(checkout, env)
        env["PYTEST_ADDOPTS"] = "--collect-only"
        test = subprocess.run(["make", "test"], cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
        output = test.stdout + test.stderr
        assert test.returncode == 0, output[-5000:]
        assert " error" not in output.splitlines()[-1] and "tests collected" in output.splitlines()[-1], output[-3000:]
    finally:
        shutil.rmtree(checkout / ".venv", ignore_errors=True)  # torch alone is most of a GB
