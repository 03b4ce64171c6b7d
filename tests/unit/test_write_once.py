"""``nanovllm_core.demo.write_once``: the demo's and the bench's random checkpoints, written on first use, are never
seen half written, and processes writing one at once all end with the one whole copy."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from nanovllm_core.demo import write_once


def slow_writer(started: threading.Barrier, tag: str):
    """A checkpoint writer that waits, with its files half written, until every writer has started."""

    def write(folder: Path) -> None:
        (folder / "model.safetensors").write_text(tag)
        started.wait(timeout=10)
        (folder / "config.json").write_text(json.dumps({"writer": tag}))

    return write


def test_writers_at_once_all_end_with_one_whole_copy(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "checkpoint"
    started = threading.Barrier(3)
    results: dict[str, Path] = {}

    def run(tag: str) -> None:
        results[tag] = write_once(path, slow_writer(started, tag))

    threads = [threading.Thread(target=run, args=(tag,)) for tag in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert set(results.values()) == {path}
    winner = json.loads((path / "config.json").read_text())["writer"]
    assert (path / "model.safetensors").read_text() == winner  # one writer's files, not a mix
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint"]  # no temporary folder left


def test_a_whole_copy_is_kept_and_a_leftover_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint"
    path.mkdir()
    (path / "model.safetensors").write_text("stopped midway")  # no config.json: a writer that died

    def write(folder: Path) -> None:
        (folder / "config.json").write_text("{}")

    assert write_once(path, write) == path
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]

    def must_not_run(folder: Path) -> None:
        raise AssertionError("a whole checkpoint is written again")

    assert write_once(path, must_not_run) == path
