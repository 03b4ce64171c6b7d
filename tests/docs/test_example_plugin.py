"""Third-party plugins as a new user meets them.

1. The example distribution ``examples/plugins/nanovllm-scheduler-spf``, pip-installed (offline) into a
   temporary folder put on ``sys.path`` (never into this environment, so ``nanovllm plugins`` lists only what
   the user installed), shows up in the registry and in ``nanovllm plugins``, passes its own tests (the
   conformance kit among them), and changing one line of a config file changes the order in which requests
   finish.
2. The tutorial (docs/tutorial-scheduler-plugin.md): its code blocks, written into an empty folder and
   installed with pip, give a plugin that ``nanovllm plugins`` lists, that passes the conformance kit, and
   that changes the engine's behaviour as the tutorial shows.
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nanovllm_testing.conformance import shared_tiny_checkpoint

from nanovllm_core import LLMEngine, SamplingParams
from nanovllm_core.cli import main
from nanovllm_core.plugins import get_registry, reset_registry

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plugins" / "nanovllm-scheduler-spf"
TUTORIAL_DOC = ROOT / "docs" / "tutorial-scheduler-plugin.md"
TUTORIAL_CODE = ROOT / "examples" / "tutorial" / "nanovllm-scheduler-decode-first"
BLOCK = re.compile(r'^```\w+ title="([^"]+)"\n(.*?)^```$', re.M | re.S)


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"


def installed_in_this_environment(dist: str) -> bool:
    """Whether a fresh interpreter of this environment (not this process, whose sys.path tests change) has
    ``dist`` installed."""
    code = f"import importlib.metadata; importlib.metadata.distribution({dist!r})"  # raises if it is missing
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60).returncode == 0


@pytest.fixture(scope="module")
def spf_installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[bool]:
    """The example plugin, copied and pip-installed (offline) into a temporary target folder on sys.path;
    yields whether this environment had it installed before (it must be unchanged afterwards)."""
    before = installed_in_this_environment("nanovllm-scheduler-spf")
    base = tmp_path_factory.mktemp("spf")
    project, site = base / "nanovllm-scheduler-spf", base / "site"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    pip("--target", str(site), str(project))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        reset_registry()
        yield before
    reset_registry()
    for name in [m for m in sys.modules if m.startswith("nanovllm_scheduler_spf")]:
        del sys.modules[name]  # its files are in a temporary folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_checkpoint(tmp_path_factory)


# --- the example distribution -----------------------------------------------------------------------


def test_the_example_is_not_installed_into_this_environment(spf_installed: bool) -> None:
    assert installed_in_this_environment("nanovllm-scheduler-spf") is spf_installed


def test_the_example_is_in_the_registry_and_listed(spf_installed: bool, capsys: pytest.CaptureFixture) -> None:
    reg = get_registry().get("scheduler", "shortest_prompt_first")
    assert (reg.distribution, reg.version, reg.module) == (
        "nanovllm-scheduler-spf", "0.1.0", "nanovllm_scheduler_spf.scheduler"
    )
    assert not [b for b in get_registry().broken if "spf" in b.plugin]
    main(["plugins"])
    row = next(line for line in capsys.readouterr().out.splitlines() if "shortest_prompt_first" in line)
    assert row.split() == [
        "scheduler", "shortest_prompt_first", "nanovllm-scheduler-spf", "0.1.0", "nanovllm_scheduler_spf.scheduler"
    ]


def finish_order(config_file: Path, prompts: list[list[int]]) -> tuple[list[str], dict[str, list[int]]]:
    """Add every request, then step; the request ids in the order they finished, and their tokens."""
    engine = LLMEngine(config=config_file)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    order, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            order.append(out.request_id)
            tokens[out.request_id] = out.outputs[0].token_ids
    return order, tokens


def test_one_config_line_switches_to_the_example_policy(spf_installed: bool, checkpoint: Path, tmp_path: Path) -> None:
    config = tmp_path / "nanovllm.toml"
    config.write_text(
        f'model = "{checkpoint}"\ndevice = "cpu"\nkvcache_block_size = 16\nnum_kvcache_blocks = 64\n'
        'max_model_len = 256\nmax_num_seqs = 1\n\n[plugins]\nscheduler = "fifo"\nattention = "torch"\n'
    )
    lengths = [50, 20, 35, 5]
    prompts = [[(7 * i + n) % 300 + 3 for i in range(n)] for n in lengths]
    fifo_order, fifo_tokens = finish_order(config, prompts)
    config.write_text(config.read_text().replace('scheduler = "fifo"', 'scheduler = "shortest_prompt_first"'))
    spf_order, spf_tokens = finish_order(config, prompts)
    assert fifo_order == ["r0", "r1", "r2", "r3"]  # arrival order
    assert spf_order == ["r3", "r1", "r2", "r0"]  # shortest prompt first
    assert spf_tokens == fifo_tokens


def test_the_example_passes_its_own_tests(
    spf_installed: bool, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Its tests: the conformance kit (``SchedulerConformance``) and the policy (order, aging, options)."""
    code = pytest.main(["-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'basetemp'}", str(EXAMPLE / "tests")])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    # the kit's 12 checks (9 of them run with and without async scheduling) and the policy's 5 tests
    assert "26 passed" in out, out[-3000:]


# --- the tutorial -----------------------------------------------------------------------------------


def tutorial_files() -> dict[str, str]:
    """The files of the tutorial: its code blocks that carry a ``title``."""
    return {title: body for title, body in BLOCK.findall(TUTORIAL_DOC.read_text())}


def test_the_tutorial_shows_its_example_code_verbatim() -> None:
    files = tutorial_files()
    kept = {str(p.relative_to(TUTORIAL_CODE)) for p in TUTORIAL_CODE.rglob("*") if p.is_file()}
    kept = {k for k in kept if not re.search(r"__pycache__|\.egg-info|^build/", k)}  # what git ignores
    assert set(files) == kept, "every file of examples/tutorial/... is one titled code block of the tutorial"
    for name, body in files.items():
        assert body == (TUTORIAL_CODE / name).read_text(), f"the tutorial's {name} differs from the example's"


@pytest.fixture(scope="module")
def tutorial_plugin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tutorial's blocks written into an empty folder, pip-installed into a separate target folder (so
    nothing changes in this environment); yields (project folder, install folder)."""
    base = tmp_path_factory.mktemp("tutorial")
    project, site = base / "nanovllm-scheduler-decode-first", base / "site"
    for name, body in tutorial_files().items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(body)
    pip("--target", str(site), str(project))
    return project, site


@pytest.fixture
def tutorial_on_path(
    tutorial_plugin: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, Path]]:
    """The installed tutorial plugin importable and discoverable in this process, for one test."""
    monkeypatch.syspath_prepend(str(tutorial_plugin[1]))
    reset_registry()
    yield tutorial_plugin
    reset_registry()


def run_with(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_tutorial_plugin_is_listed(tutorial_plugin: tuple[Path, Path]) -> None:
    project, site = tutorial_plugin
    nanovllm = Path(sys.executable).with_name("nanovllm")
    done = run_with(site, str(nanovllm), "plugins", cwd=project)
    row = next((line for line in done.stdout.splitlines() if "decode_first" in line), None)
    assert row is not None, done.stdout + done.stderr
    assert row.split() == [
        "scheduler", "decode_first", "nanovllm-scheduler-decode-first", "0.1.0", "nanovllm_decode_first.scheduler"
    ]
    assert "broken" not in done.stdout


def test_the_tutorial_plugin_passes_the_conformance_kit(
    tutorial_on_path: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``pytest tests`` in the tutorial's folder (in this process: torch and transformers are loaded already)."""
    project, _ = tutorial_on_path
    monkeypatch.chdir(project)
    code = pytest.main(["-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'basetemp'}", "tests"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "21 passed" in out  # the kit's 12 checks, 9 of them with and without async scheduling


def test_the_tutorial_plugin_changes_the_engine_as_documented(
    tutorial_on_path: tuple[Path, Path], checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    project, _ = tutorial_on_path
    shutil.copytree(checkpoint, tmp_path / "tiny-qwen3")
    shutil.copy(project / "try_it.py", tmp_path)
    config = (project / "nanovllm.toml").read_text()
    monkeypatch.chdir(tmp_path)

    def run(scheduler_line: str) -> list[str]:
        (tmp_path / "nanovllm.toml").write_text(config.replace('scheduler = "decode_first"', scheduler_line))
        runpy.run_path("try_it.py", run_name="__main__")
        return capsys.readouterr().out.splitlines()

    decode_first, fifo = run('scheduler = "decode_first"'), run('scheduler = "fifo"')
    step = re.compile(r"step (\d+): (\d+) prompt \+ (\d+) decode tokens")

    def mixed_steps(lines: list[str]) -> list[int]:
        return [int(m[1]) for line in lines if (m := step.match(line)) and int(m[2]) > 0 and int(m[3]) > 0]

    def finished(lines: list[str]) -> dict[str, tuple[int, str]]:
        done, current = {}, 0
        for line in lines:
            if m := step.match(line):
                current = int(m[1])
            elif m := re.match(r"  request (\S+) finished: (.*)", line):
                done[m[1]] = (current, m[2])
        return done

    assert mixed_steps(decode_first), "decode_first should mix prompt chunks and decode tokens in a step"
    assert not mixed_steps(fifo), "fifo runs prompt steps and decode steps apart"
    df, ff = finished(decode_first), finished(fifo)
    assert {r: t for r, (_, t) in df.items()} == {r: t for r, (_, t) in ff.items()}, "same tokens per request"
    assert df["0"][0] < ff["0"][0], "the first request finishes sooner with decode_first"
    text = TUTORIAL_DOC.read_text()
    assert "\n".join(decode_first) in text and "\n".join(fifo) in text, "the tutorial shows these outputs"
