"""The sampling defaults a checkpoint recommends (vLLM's ``--generation-config``): ``generation_config.json``'s
``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` become the defaults of requests that
leave those out (``LLM.generate`` without sampling params, and the server's requests field by field)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from nanovllm_core.config import EngineConfig
from nanovllm_core.errors import ConfigError, InvalidRequestError
from nanovllm_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(config: EngineConfig) -> dict[str, Any]:
    """The sampling fields ``config.generation_config`` sets: ``"auto"`` reads the model folder's
    ``generation_config.json`` (none there: no defaults), ``"vllm"`` none, anything else is a folder whose
    ``generation_config.json`` must exist. A value SamplingParams would refuse is left out, with a warning."""
    choice = config.generation_config
    if choice == "vllm":
        return {}
    folder = Path(config.model if choice == "auto" else choice)
    path = folder / "generation_config.json"
    if not path.is_file():
        if choice == "auto":
            return {}
        raise ConfigError(f"generation_config={choice!r}: {path} does not exist (or use 'auto' or 'vllm')")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        logger.warning("%s is not valid JSON (%s): no sampling defaults from it", path, exc)
        return {}
    defaults = {}
    for name in SAMPLING_FIELDS:
        value = data.get(name) if isinstance(data, dict) else None
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except InvalidRequestError as exc:
            logger.warning("%s: %s; left out of the sampling defaults", path, exc)
            continue
        defaults[name] = value
    return defaults
