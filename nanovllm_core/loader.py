"""Reading Hugging Face checkpoints: config.json, (sharded) safetensors, and the generic weight loader."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanovllm_core.errors import ModelLoadError


def load_hf_config(model_path: str | Path) -> Any:
    """The checkpoint's ``config.json`` through ``transformers.AutoConfig``, with clear errors."""
    from transformers import AutoConfig

    path = Path(model_path)
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory (expected a Hugging Face checkpoint)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{str(config_file)!r} is missing: a checkpoint folder needs config.json")
    try:
        json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{str(config_file)!r} is not valid JSON: {exc}") from None
    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
        raise ModelLoadError(f"{str(config_file)!r} could not be read by transformers: {exc}") from None


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a checkpoint's ``config.json`` as a dict (a checkpoint stored quantized), or
    None."""
    found = getattr(hf_config, "quantization_config", None)
    if found is None:
        return None
    if not isinstance(found, dict):
        found = found.to_dict() if hasattr(found, "to_dict") else vars(found)
    return dict(found)


def safetensors_files(model_path: str | Path) -> list[Path]:
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{str(index)!r} is not a valid safetensors index: {exc}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"safetensors shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {str(path)!r}")
    return files


def iter_safetensors(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every shard, on the CPU."""
    from safetensors import safe_open

    for file in safetensors_files(model_path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise ModelLoadError(f"{str(file)!r} is not a readable safetensors file: {exc}") from None


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules: dict[str, tuple[str, int | str]] | None = None,
    skip: tuple[str, ...] = ("rotary_emb.inv_freq",),
    tied: dict[str, str] | None = None,
) -> None:
    """Copy HF-named tensors into ``model``'s parameters, calling each parameter's ``weight_loader``.

    ``packed_modules`` maps an HF sub-name to ``(our_sub_name, shard_id)``: ``{"q_proj": ("qkv_proj", "q")}``
    loads ``...q_proj.weight`` into shard ``"q"`` of ``...qkv_proj.weight``. ``tied`` maps a parameter name
    to the one it shares storage with (loaded through the other). Every parameter must be loaded once.
    """
    params = dict(model.named_parameters())
    packed_modules = packed_modules or {}
    tied = tied or {}
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        if any(s in hf_name for s in skip):
            continue
        target, shard_id = hf_name, None
        for hf_sub, (our_sub, sid) in packed_modules.items():
            if f".{hf_sub}." in hf_name:
                target, shard_id = hf_name.replace(f".{hf_sub}.", f".{our_sub}."), sid
                break
        param = params.get(target)
        if param is None:
            if target in tied.values() or target in tied:
                continue
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} matches no parameter of {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                param.data.copy_(tensor)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except RuntimeError as exc:
            raise ModelLoadError(
                f"checkpoint tensor {hf_name!r} {tuple(tensor.shape)} does not fit {target!r}: {exc}"
            ) from None
        loaded.add(target if shard_id is None else f"{target}#{shard_id}")
    expected = set()
    for name, _ in model.named_parameters():
        if name in tied:
            continue
        shards = [sid for hf_sub, (our_sub, sid) in packed_modules.items() if f".{our_sub}." in name]
        expected.update({f"{name}#{s}" for s in shards} if shards else {name})
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ModelLoadError(f"the checkpoint is missing weights for: {shown}")
