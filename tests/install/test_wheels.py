"""The distributions as a user gets them from an index: every one built as a wheel, then the core and chosen
plugins installed from those wheels (not editable, no checkout on the path) into one fresh virtualenv.

- the core alone: ``nanovllm plugins`` and ``nanovllm generate --demo`` fail naming the distributions to install,
  so do ``nanovllm bench`` and ``nanovllm simulate`` (one line: ``pip install nanovllm-bench``); with
  ``nanovllm-testing`` beside it, the conformance kits import without pytest;
- the core with fifo, attention-flash and models-qwen3: ``nanovllm plugins`` lists exactly those and the demo runs;
- ``pip install nanovllm-scheduler-mixed`` alone brings the fifo wheel, whose ``prefix_cache`` the demo then uses;
- ``nanovllm-bench`` adds ``bench`` and ``simulate`` to ``nanovllm``, and the simulator finds its shipped
  calibrations by name.

Dependencies other than our wheels come from the package index (never our own names: a release of them on the
index must not stand in for the wheels under test); torch is pinned to the CPU build (an unpinned
torch pulls a CUDA build of several GB). Each test puts the virtualenv in the state it needs, so any one of them
runs alone.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "nanovllm-core": ROOT,
    "nanovllm-scheduler-fifo": ROOT / "plugins" / "scheduler_fifo",
    "nanovllm-scheduler-mixed": ROOT / "plugins" / "scheduler_mixed",
    "nanovllm-scheduler-priority": ROOT / "plugins" / "scheduler_priority",
    "nanovllm-attention-flash": ROOT / "plugins" / "attention_flash",
    "nanovllm-models-qwen3": ROOT / "plugins" / "models_qwen3",
    "nanovllm-structured-xgrammar": ROOT / "plugins" / "structured_xgrammar",
    "nanovllm-structured-llguidance": ROOT / "plugins" / "structured_llguidance",
    "nanovllm-quant-fp8": ROOT / "plugins" / "quant_fp8",
    "nanovllm-bench": ROOT / "plugins" / "bench",
    "nanovllm-testing": ROOT / "plugins" / "testing",
    "nanovllm-data-parallel": ROOT / "plugins" / "data_parallel",
    "nanovllm-attention-flashinfer": ROOT / "plugins" / "attention_flashinfer",
}
PLUGINS = [name for name in FOLDERS if name != "nanovllm-core"]
SUBSET = ["nanovllm-scheduler-fifo", "nanovllm-attention-flash", "nanovllm-models-qwen3"]
TORCH_PIN = "torch==2.13.0"  # the Makefile's TORCH_PIN: the CPU build


def run(*args: str | Path, cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def source_copy(folder: Path, dest: Path) -> Path:
    """What the distribution's build reads (pyproject.toml, its readme and license files, its packages), copied
    so that building leaves no build/ or egg-info in the checkout."""
    meta = tomllib.loads((folder / "pyproject.toml").read_text())
    project = meta["project"]
    files = {"pyproject.toml", project["readme"], *project["license-files"]}
    patterns = meta["tool"]["setuptools"]["packages"]["find"]["include"]
    dest.mkdir(parents=True)
    for entry in folder.iterdir():
        if entry.name in files:
            shutil.copy2(entry, dest / entry.name)
        elif entry.is_dir() and any(fnmatch.fnmatch(entry.name, p) for p in patterns):
            shutil.copytree(entry, dest / entry.name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return dest


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every distribution built as a wheel (``pip wheel --no-deps --no-build-isolation``), by name."""
    base = tmp_path_factory.mktemp("wheels")
    out = base / "dist"
    sources = [str(source_copy(folder, base / "src" / name)) for name, folder in FOLDERS.items()]
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)]
    done = subprocess.run([*cmd, *sources], capture_output=True, text=True, timeout=600)  # one pip for them all
    assert done.returncode == 0, f"building the wheels failed:\n{done.stdout}\n{done.stderr}"
    built = {path.name.split("-")[0].replace("_", "-"): path for path in out.glob("*.whl")}
    assert sorted(built) == sorted(FOLDERS)
    return built


class Venv:
    """A fresh virtualenv without pip of its own: this environment's pip installs into it (``--python``)."""

    def __init__(self, root: Path, find_links: Path) -> None:
        venv.EnvBuilder(symlinks=True, with_pip=False).create(root)
        self.bin = root / "bin"
        self.find_links = find_links
        self.cwd = root.parent  # no checkout on the path
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.env = {**env, "PATH": f"{self.bin}{os.pathsep}{env.get('PATH', '')}", "NANOVLLM_CACHE": str(root.parent)}

    def pip(self, *args: str | Path) -> None:
        cmd = [sys.executable, "-m", "pip", "--python", self.bin / "python", *args]
        done = run(*cmd, cwd=self.cwd, env=self.env)
        assert done.returncode == 0, f"pip {' '.join(map(str, args))} failed:\n{done.stdout}\n{done.stderr}"

    def install(self, *requirements: str | Path) -> None:
        self.pip("install", "-q", "--find-links", self.find_links, TORCH_PIN, *requirements)

    def uninstall(self, *names: str) -> None:
        self.pip("uninstall", "-q", "-y", *names)

    def distributions(self) -> set[str]:
        code = "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"
        done = run(self.bin / "python", "-c", code, cwd=self.cwd, env=self.env)
        assert done.returncode == 0, done.stderr
        return {name for name in done.stdout.split() if name.startswith("nanovllm-")}

    def nanovllm(self, *args: str) -> subprocess.CompletedProcess:
        return run(self.bin / "nanovllm", *args, cwd=self.cwd, env=self.env)


@pytest.fixture(scope="module")
def env(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    root = tmp_path_factory.mktemp("fresh") / "venv"
    env = Venv(root, wheels["nanovllm-core"].parent)
    env.install(wheels["nanovllm-core"])
    yield env
    shutil.rmtree(root, ignore_errors=True)  # torch alone is most of a GB; pytest keeps its last temp folders


def listed(output: str) -> dict[str, set[str]]:
    """``nanovllm plugins``' table as {distribution: {"kind name", ...}}."""
    rows: dict[str, set[str]] = {}
    for line in output.splitlines()[1:]:
        if not line.strip():
            break
        cells = line.split()
        if cells[0].strip("*!") == "":
            cells = cells[1:]
        rows.setdefault(cells[2], set()).add(f"{cells[0]} {cells[1]}")
    return rows


def test_every_wheel_declares_its_license_and_what_it_needs(wheels: dict[str, Path]) -> None:
    for name, wheel in wheels.items():
        with zipfile.ZipFile(wheel) as zf:
            info = next(n.rsplit("/", 1)[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            metadata = Parser().parsestr(zf.read(f"{info}/METADATA").decode())
            assert metadata["License-Expression"] == "MIT", name
            assert metadata.get_all("License-File") == ["LICENSE"], name
            assert "MIT License" in zf.read(f"{info}/licenses/LICENSE").decode(), name
            assert "](../" not in metadata.get_payload(), f"{name}'s description links to repository paths"
            requires = metadata.get_all("Requires-Dist") or []
        if name in ("nanovllm-scheduler-mixed", "nanovllm-scheduler-priority"):
            assert any(r.startswith("nanovllm-scheduler-fifo") and "extra" not in r for r in requires), requires
        if name == "nanovllm-core":
            assert 'tomli>=1.1; python_version < "3.11"' in requires, requires
        if name == "nanovllm-bench":  # the simulator's shipped calibrations, found by name
            with zipfile.ZipFile(wheel) as zf:
                shipped = [n for n in zf.namelist() if n.startswith("nanovllm_bench/simulate/calibrations/")]
            assert "nanovllm_bench/simulate/calibrations/h200-qwen3-0.6b-bf16.json" in shipped, shipped


def test_the_core_alone_names_the_distributions_to_install(env: Venv, wheels: dict[str, Path]) -> None:
    env.uninstall(*PLUGINS)
    assert env.distributions() == {"nanovllm-core"}
    plugins = env.nanovllm("plugins")
    assert plugins.returncode == 1, plugins.stdout + plugins.stderr
    for dist in SUBSET:
        assert f"pip install {dist}" in plugins.stdout, plugins.stdout
    demo = env.nanovllm("generate", "--demo", "--max-tokens", "4", "--no-progress")
    assert demo.returncode != 0 and "pip install nanovllm-scheduler-fifo" in demo.stderr, demo.stdout + demo.stderr
    for command in ("bench", "simulate"):
        done = env.nanovllm(command, "--help")
        assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
        assert done.stderr == (
            f"error: `nanovllm {command}` is not installed. It ships in nanovllm-bench: pip install nanovllm-bench\n"
        )
    env.install(wheels["nanovllm-testing"])
    kits = "import nanovllm_testing.conformance, nanovllm_testing.simulated"
    done = run(env.bin / "python", "-c", f"import importlib.util as u; assert u.find_spec('pytest') is None; {kits}",
               cwd=env.cwd, env=env.env)
    assert done.returncode == 0, done.stderr


def test_the_core_and_a_subset_run_the_demo(env: Venv, wheels: dict[str, Path]) -> None:
    env.uninstall(*PLUGINS)
    env.install(*(wheels[name] for name in SUBSET))
    plugins = env.nanovllm("plugins")
    assert plugins.returncode == 0, plugins.stdout + plugins.stderr
    # nanovllm-core lists its own reply parsers
    assert set(listed(plugins.stdout)) == {"nanovllm-core", *SUBSET}, plugins.stdout
    assert {"scheduler fifo", "block_manager prefix_cache"} == listed(plugins.stdout)["nanovllm-scheduler-fifo"]
    demo = env.nanovllm("generate", "--demo", "--max-tokens", "4", "--no-progress")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert demo.stdout.count("--- prompt:") == 3 and "(4 tokens, length)" in demo.stdout, demo.stdout


def test_installing_mixed_alone_brings_the_prefix_cache_block_manager(env: Venv, wheels: dict[str, Path]) -> None:
    env.uninstall(*PLUGINS)
    env.install(*(wheels[name] for name in SUBSET))  # with what fifo needs from the index (xxhash)
    env.uninstall("nanovllm-scheduler-fifo")
    assert "nanovllm-scheduler-fifo" not in env.distributions()
    # no index: only the wheels can provide nanovllm-scheduler-fifo, and pip asks for it only if mixed declares it
    env.pip("install", "-q", "--no-index", "--find-links", env.find_links, "nanovllm-scheduler-mixed")
    assert env.distributions() == {"nanovllm-core", "nanovllm-scheduler-mixed", "nanovllm-scheduler-fifo",
                                   "nanovllm-attention-flash", "nanovllm-models-qwen3"}
    plugins = env.nanovllm("plugins", "--config", str(write_config(env.cwd, "mixed")))
    assert plugins.returncode == 0, plugins.stdout + plugins.stderr
    assert "block_manager prefix_cache" in listed(plugins.stdout)["nanovllm-scheduler-fifo"], plugins.stdout
    demo = env.nanovllm("generate", "--demo", "--max-tokens", "4", "--no-progress", "--scheduler", "mixed")
    assert demo.returncode == 0, demo.stdout + demo.stderr


def test_the_bench_wheel_adds_its_commands_and_finds_its_calibrations(env: Venv, wheels: dict[str, Path]) -> None:
    env.uninstall(*PLUGINS)
    env.install(*(wheels[name] for name in SUBSET), wheels["nanovllm-bench"])
    help_text = env.nanovllm("--help")
    assert help_text.returncode == 0 and "Not installed" not in help_text.stdout, help_text.stdout + help_text.stderr
    assert "throughput benchmark" in help_text.stdout and "judge a scheduler policy" in help_text.stdout
    listed_calibrations = env.nanovllm("simulate", "--list-calibrations")
    assert listed_calibrations.returncode == 0, listed_calibrations.stdout + listed_calibrations.stderr
    assert "h200-qwen3-0.6b-bf16: NVIDIA H200" in listed_calibrations.stdout, listed_calibrations.stdout
    simulated = env.nanovllm("simulate", "--calibration", "h200-qwen3-8b-fp8", "--num-prompts", "20")
    assert simulated.returncode == 0, simulated.stdout + simulated.stderr


def write_config(folder: Path, scheduler: str) -> Path:
    path = folder / f"{scheduler}.toml"
    path.write_text(f'[plugins]\nscheduler = "{scheduler}"\n')
    return path
