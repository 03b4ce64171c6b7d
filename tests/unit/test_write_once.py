"""``nanovllm_core.demo.write_once``: the demo's and the bench's random checkpoints, written on first use, are never
seen half written; processes asking for one at once wait for the one writer, and what a writer stopped midway left
is removed by the next."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from nanovllm_core.demo import write_once


def test_one_writer_and_the_others_wait_for_its_whole_copy(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "checkpoint"
    writing, release = threading.Event(), threading.Event()
    writes: list[str] = []
    results: dict[str, Path] = {}

    def writer(tag: str):
        def write(folder: Path) -> None:
            writes.append(tag)
            (folder / "model.safetensors").write_text(tag)
            writing.set()
            release.wait(timeout=10)
            (folder / "config.json").write_text(json.dumps({"writer": tag}))

        return write

    def run(tag: str) -> None:
        results[tag] = write_once(path, writer(tag))

    first = threading.Thread(target=run, args=("a",))
    first.start()
    assert writing.wait(timeout=10)
    others = [threading.Thread(target=run, args=(tag,)) for tag in ("b", "c")]
    for t in others:
        t.start()
    others[0].join(timeout=0.3)
    assert not path.exists(), "a half-written checkpoint should not be at its path"
    assert all(t.is_alive() for t in others), "the other callers should wait for the writer"
    release.set()
    for t in [first, *others]:
        t.join(timeout=30)
    assert writes == ["a"] and set(results) == {"a", "b", "c"} and set(results.values()) == {path}
    assert json.loads((path / "config.json").read_text()) == {"writer": "a"}
    assert (path / "model.safetensors").read_text() == "a"
    assert [p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")] == ["checkpoint"]


def test_a_whole_copy_is_kept_and_leftovers_are_replaced(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint"
    path.mkdir()
    (path / "model.safetensors").write_text("stopped midway")  # no config.json: a writer that died in place
    stale = tmp_path / ".checkpoint.partial-dead"  # a writer that died in its temporary folder
    stale.mkdir()
    (stale / "model.safetensors").write_text("stopped midway")
    neighbour = tmp_path / "checkpoint-8b"
    neighbour.mkdir()

    def write(folder: Path) -> None:
        (folder / "config.json").write_text("{}")

    assert write_once(path, write) == path
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        "checkpoint",
        "checkpoint-8b",
    ]

    def must_not_run(folder: Path) -> None:
        raise AssertionError("a whole checkpoint is written again")

    assert write_once(path, must_not_run) == path


def test_a_failed_write_leaves_nothing_and_the_next_call_writes(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint"

    def fails(folder: Path) -> None:
        (folder / "model.safetensors").write_text("half")
        raise OSError("disk full")

    try:
        write_once(path, fails)
    except OSError as exc:
        assert str(exc) == "disk full"
    else:
        raise AssertionError("the writer's error should reach the caller")
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    assert write_once(path, lambda folder: (folder / "config.json").write_text("{}")) == path
    assert (path / "config.json").is_file()
