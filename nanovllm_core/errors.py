"""Exceptions raised by the engine. Every message says what was wrong and what is allowed."""


class NanoVLLMError(Exception):
    """Base class of every error the engine raises on purpose."""


class ConfigError(NanoVLLMError, ValueError):
    """An engine configuration value is invalid (raised before any weights load)."""


class PluginError(NanoVLLMError):
    """A plugin could not be found, loaded or registered."""


class UnknownPluginError(PluginError, ValueError):
    """A config names a plugin that no installed distribution registers."""


class PluginConflictError(PluginError):
    """Two plugins registered the same name for the same kind."""


class SchedulerError(PluginError):
    """A scheduler plugin returned a step that breaks the Scheduler invariants (the message names the plugin)."""


class InvalidRequestError(NanoVLLMError, ValueError):
    """A request (prompt or sampling parameters) can never be served; nothing was queued."""


class ModelLoadError(NanoVLLMError):
    """A checkpoint is missing, corrupt or not supported by any installed model plugin."""
