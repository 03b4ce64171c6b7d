from find_models_command import FindModels
from nanovllm_testing import write_tiny_checkpoint

from nanovllm_core import register_plugin, unregister_plugin
from nanovllm_core.cli import main


def test_find_models_lists_each_checkpoint(tmp_path, capsys):
    import find_models_command

    write_tiny_checkpoint(tmp_path / "a", "qwen3")
    write_tiny_checkpoint(tmp_path / "b" / "c", "qwen2")
    register_plugin(find_models_command)
    try:
        assert main(["find-models", str(tmp_path)]) == 0
        assert main(["find-models", str(tmp_path / "a" / "nothing")]) == 1
    finally:
        unregister_plugin("find_models_command")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{tmp_path / 'a'}  Qwen3ForCausalLM", f"{tmp_path / 'b' / 'c'}  Qwen2ForCausalLM"]
    assert FindModels.help
