"""Building plugin objects with their per-plugin options from the config."""

from __future__ import annotations

from typing import Any

from nanovllm_core.errors import ConfigError


def instantiate(kind: str, cls: type, options: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    """Build a plugin object, turning an unknown option into a ConfigError that lists the accepted ones."""
    options_model = getattr(cls, "Options", None)
    if options_model is not None:
        try:
            options = options_model(**options).model_dump()
        except Exception as exc:  # noqa: BLE001 - pydantic ValidationError
            raise ConfigError(f"invalid plugins.{kind}_options for {cls.__name__}: {exc}") from None
    try:
        return cls(*args, **kwargs, **options)
    except TypeError as exc:
        if options and "unexpected keyword" in str(exc):
            raise ConfigError(
                f"plugins.{kind}_options {sorted(options)} not accepted by {cls.__name__}: {exc}"
            ) from None
        raise
