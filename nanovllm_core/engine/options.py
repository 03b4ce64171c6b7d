"""Per-plugin options from the config: validated (before any weights load), then handed to the plugin class."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from pydantic import BaseModel, ValidationError

from nanovllm_core.config import describe_error
from nanovllm_core.errors import ConfigError

_CORE_MODULE = "nanovllm_core.interfaces"


def validate_options(kind: str, cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The options for ``cls`` (a ``kind`` plugin: ``scheduler``, ``block_manager`` or ``attention``), checked.

    A class with a pydantic ``Options`` model gets them validated by it (strictly, like the engine config) and
    back with the defaults filled in; for any other class the names are checked against its constructor.
    Raises :class:`ConfigError` naming the bad option and listing the accepted ones.
    """
    model = getattr(cls, "Options", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        try:
            return model.model_validate(options, strict=True).model_dump()
        except ValidationError as exc:
            raise ConfigError(_format_errors(kind, cls, exc, _model_options(model))) from None
    accepted = _constructor_options(cls)
    if accepted is None:  # the constructor takes **kwargs that go somewhere we cannot see
        return dict(options)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"plugins.{kind}_options {unknown} not accepted by {cls.__name__}; accepted options: "
            f"{_accepted_text(accepted)}"
        )
    return dict(options)


def instantiate(kind: str, cls: type, options: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    """Build a plugin object with its validated options (:func:`validate_options`) as keyword arguments."""
    return cls(*args, **kwargs, **validate_options(kind, cls, options))


def _format_errors(kind: str, cls: type, exc: ValidationError, accepted: dict[str, str]) -> str:
    lines = [f"invalid plugins.{kind}_options for {cls.__name__}:"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        field = f"plugins.{kind}_options" + (f".{where}" if where else "")
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(err["loc"][-1]), list(accepted), n=1)
            msg = "unknown option" + (f"; did you mean {close[0]!r}?" if close else "")
        else:
            msg = describe_error(err)
        lines.append(f"  {field}: {msg}")
    lines.append(f"accepted options: {_accepted_text(accepted)}")
    return "\n".join(lines)


def _accepted_text(accepted: dict[str, str]) -> str:
    if not accepted:
        return "none (it takes no options)"
    return ", ".join(f"{name} (default {default})" if default else name for name, default in accepted.items())


def _model_options(model: type[BaseModel]) -> dict[str, str]:
    return {
        name: "" if field.is_required() else repr(field.get_default(call_default_factory=True))
        for name, field in model.model_fields.items()
    }


def _constructor_options(cls: type) -> dict[str, str] | None:
    """Keyword options the constructors of ``cls`` take (name -> default as text), or ``None`` if unknowable.

    Walks the class's ``__init__`` methods up the MRO while each passes ``**kwargs`` on, down to the core's
    interface class, whose own parameters are what the engine passes (not options) and whose ``**options``
    accept nothing.
    """
    accepted: dict[str, str] = {}
    inits = [k.__dict__["__init__"] for k in cls.__mro__ if "__init__" in k.__dict__]
    core = next((init for init in inits if getattr(init, "__module__", None) == _CORE_MODULE), None)
    if core is None:
        return None
    core_params = set(inspect.signature(core).parameters)
    for init in inits:
        if init is core:
            break
        try:
            params = list(inspect.signature(init).parameters.values())[1:]  # without self
        except (TypeError, ValueError):
            return None
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in accepted:
                accepted[p.name] = "" if p.default is p.empty else repr(p.default)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return {name: default for name, default in accepted.items() if name not in core_params}
