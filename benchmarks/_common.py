"""What the benchmark scripts share: the results folder, the engine's command line (parsed before it runs, shown as
a user would type it), the machine a result came from, and a server started and stopped cleanly.

Not a package: ``python benchmarks/NAME.py`` puts this folder first on ``sys.path``, where ``from _common import``
finds it. Tests import a script with ``nanovllm_testing.scripts.load_script``, which puts the folder there
only while the script loads.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "nanovllm_core.cli"]  # the engine of the Python that runs the script


def add_common_arguments(parser: argparse.ArgumentParser, dry_run: bool = True) -> None:
    parser.add_argument(
        "--results-dir",
        default="results",
        help="folder for the JSON results and logs, made if missing (default: results, git-ignored at the "
        "repository root)",
    )
    if dry_run:
        parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")


def out_dir(results_dir: str, name: str, make: bool = True) -> Path:
    path = Path(results_dir) / name
    if make:
        path.mkdir(parents=True, exist_ok=True)
    return path


def nanovllm(*args: str) -> list[str]:
    """A ``nanovllm`` command, run by this script's Python (so the engine is the one installed beside it)."""
    return [*CLI, *args]


def shown(cmd: list[str]) -> str:
    """``cmd`` as a user would type it: ``nanovllm ...`` or ``python benchmarks/...``."""
    if cmd[: len(CLI)] == CLI:
        cmd = ["nanovllm", *cmd[len(CLI) :]]
    elif cmd and cmd[0] == sys.executable:
        cmd = ["python", *(_relative(c) for c in cmd[1:])]
    return shlex.join(cmd)


def _relative(arg: str) -> str:
    path = Path(arg)
    if path.is_absolute() and path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    return arg


def check_cli(cmd: list[str]) -> None:
    """Parse a ``nanovllm`` command with the engine's own parser, so that a flag this version of the CLI does not
    have stops the script before anything runs (a typo or a renamed flag would otherwise surface minutes later)."""
    from nanovllm_core.cli import build_parser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            build_parser().parse_args(cmd[len(CLI) :])
    except SystemExit:
        reason = (stderr.getvalue().strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"error: `{shown(cmd)}` does not parse with the installed nanovllm: {reason}") from None


def run_cli_in_process(argv: list[str], log: Path | None = None) -> None:
    """``nanovllm ARGV`` in this process, where a process of its own would only import torch and the engine again
    (a simulation: deterministic, and nothing else runs by then). Its output goes to ``log`` (stderr too) or is
    dropped (stderr kept); a failure exits naming the command."""
    from nanovllm_core.cli import main as cli_main

    with contextlib.ExitStack() as stack:
        out = stack.enter_context(log.open("w")) if log else io.StringIO()
        stack.enter_context(contextlib.redirect_stdout(out))
        if log:
            stack.enter_context(contextlib.redirect_stderr(out))
        code = cli_main(argv)
    if code != 0:
        raise SystemExit(f"error: nanovllm {' '.join(argv)} exited with {code}" + (f": see {log}" if log else ""))


def run(cmd: list[str], log: Path) -> int:
    """Run ``cmd``, its output on the terminal and in ``log``; its exit status."""
    print(f"$ {shown(cmd)}", flush=True)
    with open(log, "w") as f:
        f.write(f"$ {shown(cmd)}\n")
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)
            return proc.wait()


def machine() -> dict[str, str]:
    """The GPU, the date (UTC) and the commit a result belongs with."""
    return {
        "gpu": gpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "commit": commit(),
    }


def gpu_name() -> str:
    # nvidia-smi rather than torch: the scripts' own process stays off the GPU the engine measures
    try:
        out = _output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return names[0] if names else "unknown"


def commit() -> str:
    """The checkout's short commit, ``-dirty`` when tracked files differ from it; ``unknown`` outside git."""
    try:
        head = _output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
        dirty = _output(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def _output(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout.strip()


def random_checkpoint(shape: str, dry_run: bool = False) -> Path:
    """The random-weight bf16 checkpoint of ``shape`` that ``nanovllm bench`` measures (written on first use; a dry
    run only names it)."""
    if dry_run:
        return Path(f"/tmp/nanovllm-bench-{shape}-bfloat16")
    import torch
    from nanovllm_bench.offline import random_checkpoint as write_checkpoint

    return Path(write_checkpoint(shape, torch.bfloat16))


def copy_bytes_per_s() -> float:
    """The CUDA device's copy rate, bytes read + written per second, as ``nanovllm bench`` counts it for its bound."""
    import torch
    from nanovllm_bench.device import measure_device

    return measure_device(torch.device("cuda"))["copy_bytes_per_s"]


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


class Server:
    """``nanovllm serve`` in the background, ready once ``/health`` answers; stopped with SIGTERM (the server's own
    graceful stop) and killed only if it outlives ``stop_timeout`` seconds. Its output goes to ``log``."""

    def __init__(self, cmd: list[str], log: Path, port: int, start_timeout: float = 900, stop_timeout: float = 60):
        self.cmd, self.log, self.port = cmd, log, port
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        print(f"$ {shown(self.cmd)} > {self.log}", flush=True)
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"error: the server exited with status {self.proc.returncode} before it was "
                    f"ready; the end of {self.log}:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)  # a refused connection costs nothing: ready within a tenth of a second of it
        self.stop()
        raise SystemExit(
            f"error: the server did not answer /health within {self.start_timeout:g} s; the end of "
            f"{self.log}:\n{self.tail()}"
        )

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metrics(self) -> str:
        """The server's Prometheus text (its own account of where the time went), or "" if it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
                return response.read().decode()
        except (urllib.error.URLError, OSError):
            return ""

    def stop(self) -> None:
        if self.proc is None or self.exit_code is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.exit_code = self.proc.wait()
            print(f"the server did not stop within {self.stop_timeout:g} s of SIGTERM and was killed")
        print(f"server stopped (exit status {self.exit_code})", flush=True)

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def serve_command(checkpoint: str, port: int, max_model_len: int, *flags: str) -> list[str]:
    """``nanovllm serve`` of ``checkpoint`` on 127.0.0.1."""
    return nanovllm(
        "serve", checkpoint, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len), *flags
    )


def bench_serve_command(port: int, result: Path, *flags: str, processes: int) -> list[str]:
    """``nanovllm bench serve`` against the server on 127.0.0.1, its results written to ``result``."""
    return nanovllm(
        "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", *flags,
        "--client-processes", str(processes), "--result-file", str(result),
    )  # fmt: skip


def add_server_arguments(parser: argparse.ArgumentParser, port: int = 8000, start_timeout: float = 900) -> None:
    parser.add_argument("--port", type=int, default=port, help=f"the server's port on 127.0.0.1 (default {port})")
    parser.add_argument(
        "--start-timeout", type=float, default=start_timeout,
        help=f"seconds the server may take to start (default {start_timeout:g})",
    )  # fmt: skip


def add_client_processes_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="processes sending the requests (default 4: one Python client reading hundreds of "
        "streams adds its own delay to what it measures)",
    )


def require_positive(args: argparse.Namespace, *names: str) -> None:
    """Each named integer option is at least 1; a clear error naming the flag otherwise."""
    for name in names:
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: at least 1")


def user_command(script: str, argv: list[str]) -> str:
    """A run as docs/performance.md quotes it: the script and the flags given, less the results folder."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--results-dir":
            skip = True
        elif not arg.startswith("--results-dir="):
            kept.append(arg)
    return shlex.join(["python", script, *kept])


def markdown_row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def add_selection_argument(parser: argparse.ArgumentParser, flag: str, names: list[str] | dict[str, Any]) -> None:
    """``flag``: a comma-separated selection from ``names`` (default: all of them), read with :func:`split_list`."""
    parser.add_argument(
        flag, default=",".join(names), help=f"comma-separated subset of {', '.join(names)} (default: all)"
    )


def split_list(text: str, allowed: list[str] | dict[str, Any], what: str) -> list[str]:
    """A comma-separated selection from ``allowed``, in the given order; a clear error for a name not in it."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(f"error: {what} {text!r}: choose from {', '.join(allowed)} (comma-separated)")
    return names


def parse_ints(text: str, name: str) -> list[int]:
    """Comma-separated positive integers for the flag ``--name``; a clear error otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"--{name} takes positive integers separated by commas, e.g. 1,2,4 (got {text!r})")
    return values


def parse_numbers(text: str, what: str) -> list[float]:
    """Comma-separated positive numbers (``inf`` allowed); a clear error otherwise."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise SystemExit(f"error: {what} {text!r}: comma-separated numbers above 0 (or inf), e.g. 0.3,0.7,inf")
    return values
