"""The command line: ``nanovllm serve`` takes every engine flag, and bad serving flags fail before any model loads
(``nanovllm bench`` and its ``serve`` mode: plugins/bench/tests)."""

from __future__ import annotations

from nanovllm_core.cli import build_parser, cli_overrides, cmd_serve, main


def test_serve_parses_server_and_engine_flags():
    args = build_parser().parse_args(
        ["serve", "/m", "--port", "0", "--api-key", "k", "--max-queued-requests", "3", "--max-num-seqs", "4"]
        + ["--served-model-name", "mine", "--scheduler", "fifo", "--no-enable-prefix-caching", "--config", "c.toml"]
    )
    assert args.func is cmd_serve and args.model_path == "/m" and args.port == 0 and args.api_key == "k"
    assert args.max_queued_requests == 3 and args.served_model_name == ["mine"] and args.config == "c.toml"
    assert build_parser().parse_args(["serve", "/m", "--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    assert args.host == "127.0.0.1" and args.shutdown_timeout == 10.0 and args.engine_process is True
    assert build_parser().parse_args(["serve", "/m", "--no-engine-process"]).engine_process is False
    overrides = cli_overrides(args)
    assert overrides["max_num_seqs"] == 4 and overrides["enable_prefix_caching"] is False
    assert overrides["plugins"] == {"scheduler": "fifo"}


def test_bad_serving_flags_fail_before_loading(capsys):
    assert main(["serve", "/does/not/exist", "--max-queued-requests", "0"]) == 2
    assert "--max-queued-requests 0" in capsys.readouterr().err
    assert main(["serve", "/does/not/exist", "--shutdown-timeout", "-1"]) == 2
    assert "--shutdown-timeout" in capsys.readouterr().err


def test_missing_serve_extra_is_a_clear_error(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["serve", "/does/not/exist"]) == 2
    err = capsys.readouterr().err
    assert "missing: fastapi" in err and "pip install 'nanovllm-core[serve]'" in err


def test_chat_template_flag_reads_a_file_or_takes_the_template(tmp_path, capsys):
    from nanovllm_core.serving.serve import read_chat_template

    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    assert read_chat_template(None) is None
    assert main(["serve", "/does/not/exist", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "no such file, and not a Jinja template" in capsys.readouterr().err


def test_a_model_folder_after_the_served_names_is_the_model(tmp_path):
    from nanovllm_core.serving.serve import take_model_from_names

    args = build_parser().parse_args(["serve", "--served-model-name", "mine", str(tmp_path)])
    assert args.model_path is None and args.served_model_name == ["mine", str(tmp_path)]  # argparse's reading
    take_model_from_names(args)
    assert args.model_path == str(tmp_path) and args.served_model_name == ["mine"]
    named = build_parser().parse_args(["serve", str(tmp_path), "--served-model-name", "a", "b"])
    take_model_from_names(named)
    assert named.model_path == str(tmp_path) and named.served_model_name == ["a", "b"]


def test_front_end_stack_names_the_loop_and_parser_and_what_to_install(monkeypatch):
    import importlib.util

    from nanovllm_core.serving.serve import front_end_stack

    real = importlib.util.find_spec
    present = {"uvloop": True, "httptools": True}  # as if installed or not, whatever this machine has

    def find_spec(name, *args):
        if name in present:
            return object() if present[name] else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr("sys.platform", "linux")
    assert front_end_stack() == (True, "front-end on uvloop and httptools")
    present["uvloop"] = False
    fast, line = front_end_stack()
    assert not fast and line.startswith("front-end on asyncio and httptools (uvloop not installed: pip install")
    present["httptools"] = False
    fast, line = front_end_stack()
    assert not fast and "front-end on asyncio and h11 (uvloop and httptools not installed" in line
    monkeypatch.setattr("sys.platform", "win32")  # no uvloop there: only the parser is asked for
    fast, line = front_end_stack()
    assert line.startswith("front-end on asyncio and h11 (httptools not installed")
    present["httptools"] = True
    assert front_end_stack() == (True, "front-end on asyncio and httptools")
