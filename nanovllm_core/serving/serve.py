"""``nanovllm serve MODEL``: load the engine, then serve the OpenAI API with uvicorn until SIGTERM / SIGINT.

On SIGTERM or SIGINT the server drains: new requests get 503 (Retry-After), in-flight requests may finish for up
to ``--shutdown-timeout`` seconds, then the rest are aborted (a stream ends with finish_reason "abort" and
``data: [DONE]``, a whole response is a 503 error), the engine stops and the process exits 0. A second signal
ends the wait at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from types import FrameType
from typing import Any

from nanovllm_core.errors import ConfigError
from nanovllm_core.serving.admission import BODY_BYTES_PER_TOKEN, BODY_JSON_ROOM, check_max_request_body_bytes

DEMO_SERVED_MODEL_NAME = "demo"
# the flags that ServerSettings takes as they are, by the same names
SETTINGS_AS_GIVEN = ("max_queued_requests", "enable_auto_tool_choice", "tool_call_parser", "reasoning_parser",
                     "max_request_body_bytes", "shutdown_timeout", "request_timeline")  # fmt: skip


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_path", nargs="?", metavar="MODEL", help="checkpoint folder (or `model` in --config)")
    parser.add_argument(
        "--model", dest="model_flag", help="the checkpoint folder as a flag (vLLM's; the MODEL argument wins)"
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="serve the embedded tiny random-weight Qwen3 demo (no GPU or download needed; written on first use), "
        f"under the name {DEMO_SERVED_MODEL_NAME!r} unless --served-model-name says otherwise",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $NANOVLLM_API_KEY, else vLLM's $VLLM_API_KEY; "
        "neither set: no key)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        help="the model name clients send (default: the MODEL argument); several names: clients may send any, "
        "responses carry the first (vLLM's flag)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="answer 503 (Retry-After) when this many requests are waiting for their first token (default: no limit)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they are aborted (new "
        "requests get 503 meanwhile; a second signal aborts at once)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help=f"answer 413 to a request body larger than this, before reading it (default: {BODY_BYTES_PER_TOKEN} "
        f"bytes per token of max_model_len plus {BODY_JSON_ROOM >> 20} MiB for the rest of the JSON; raise it to send "
        "batches of long prompts)",
    )
    parser.add_argument(
        "--request-timeline",
        metavar="FILE",
        help="write each finished request's timeline to FILE, a JSON object a line: when the server received it, "
        "validated it and handed it to the engine, when the engine took it, first scheduled it, scheduled its "
        "prompt's last chunk, read its first token and finished it, and when the front-end had its first and last "
        "output (time.monotonic() seconds; `nanovllm simulate --calibrate --request-timelines` reads it)",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine's step loop in a process of its own, so that it shares no GIL with the HTTP work "
        "(default; --no-engine-process: a thread of the server; docs/serving.md has the measurements)",
    )
    parser.add_argument(
        "--chat-template",
        help="a Jinja chat template for /v1/chat/completions instead of the tokenizer's: a file, or the template "
        "itself (vLLM's flag)",
    )
    parser.add_argument(
        "--allowed-origins",
        help="CORS: a JSON list of the origins whose browser pages may call the API, e.g. "
        "'[\"http://localhost:3000\"]' or '[\"*\"]' (vLLM's flag; default: none, unlike vLLM's \"*\": any web "
        "page the user opens could otherwise call this server)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse chat replies to requests with tools (tool_choice "auto") for tool calls (vLLM\'s flag; needs '
        "--tool-call-parser)",
    )
    parser.add_argument(
        "--tool-call-parser",
        help="how the model writes tool calls: hermes (Hermes, Qwen2.5, Qwen3: <tool_call>{...}</tool_call>), or "
        "one a plugin registers (`nanovllm plugins` lists them)",
    )
    parser.add_argument(
        "--reasoning-parser",
        help="return a reasoning model's thinking (<think>...</think>) as reasoning_content: qwen3, deepseek_r1, "
        "or one a plugin registers (vLLM's flag)",
    )
    parser.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        dest="log_level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the server's and the engine's log level (--uvicorn-log-level: vLLM's name)",
    )


def resolve_api_key(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The API key: ``--api-key``, else ``$NANOVLLM_API_KEY``, else vLLM's ``$VLLM_API_KEY`` (an empty value counts
    as unset); None: no key."""
    environ = os.environ if environ is None else environ
    return flag or environ.get("NANOVLLM_API_KEY") or environ.get("VLLM_API_KEY") or None


def resolve_model(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    """The checkpoint to serve, into ``overrides["model"]``: the MODEL argument, else ``--model``, else with ``--demo``
    the demo checkpoint (and, unless set, a ``max_model_len`` that fits it and the demo's served name); and the
    served names' default, the model as given."""
    take_model_from_names(args)
    model = args.model_path or args.model_flag
    if args.demo:
        if model:
            raise ConfigError(f"--demo serves the demo checkpoint: leave out the model ({model!r}) or --demo")
        from nanovllm_core.demo import DEMO_MAX_MODEL_LEN, ensure_demo_checkpoint

        model = str(ensure_demo_checkpoint())
        overrides.setdefault("max_model_len", DEMO_MAX_MODEL_LEN)
        if not args.served_model_name:
            args.served_model_name = [DEMO_SERVED_MODEL_NAME]
    if model:
        overrides["model"] = model
        args.model_path = model
        if not args.served_model_name:
            args.served_model_name = [model]  # a model named only in a TOML --config: run_serve takes the engine's


def take_model_from_names(args: argparse.Namespace) -> None:
    """``nanovllm serve --served-model-name NAME MODEL``: the names (several allowed) took the MODEL argument
    too; a last name that is a folder, with no MODEL given, is the model."""
    names = args.served_model_name
    if names and len(names) > 1 and args.model_path is None and os.path.isdir(names[-1]):
        args.model_path = names.pop()


def read_allowed_origins(value: str | None) -> list[str] | None:
    """``--allowed-origins``: a JSON list of strings."""
    if value is None:
        return None
    try:
        origins = json.loads(value)
    except ValueError:
        origins = None
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise ConfigError(f'--allowed-origins {value!r}: a JSON list of origins, e.g. \'["http://localhost:3000"]\'')
    return origins


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: the file's text, or the value itself when it is a template (it holds ``{``)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" in value:
        return value
    raise ConfigError(f"--chat-template {value!r}: no such file, and not a Jinja template (no '{{' in it)")


SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "httpx")


def missing_modules(modules: list[str] | tuple[str, ...]) -> list[str]:
    """Those of ``modules`` that cannot be imported here (looked up, not imported)."""
    import importlib.util

    return [m for m in modules if importlib.util.find_spec(m) is None]


def require_serve_extra() -> None:
    """A clear error when the ``[serve]`` extra is not installed."""
    missing = missing_modules(SERVE_MODULES)
    if missing:
        raise ConfigError(
            f"serving needs the [serve] extra (missing: {', '.join(missing)}): pip install 'nanovllm-core[serve]'"
        )


def front_end_stack() -> tuple[bool, str]:
    """Whether the front-end gets uvicorn's fast event loop and HTTP parser (uvloop, httptools: the ``[serve]``
    extra installs both, uvloop not on Windows; uvicorn falls back to asyncio and h11 without them), and a line
    saying which it runs on."""
    missing = missing_modules(["httptools"] if sys.platform == "win32" else ["uvloop", "httptools"])
    loop = "asyncio" if "uvloop" in missing or sys.platform == "win32" else "uvloop"
    http = "h11" if "httptools" in missing else "httptools"
    line = f"front-end on {loop} and {http}"
    if missing:
        line += f" ({' and '.join(missing)} not installed: pip install 'nanovllm-core[serve]' installs them)"
    return not missing, line


LAST_WRITES_TIMEOUT = 5.0  # seconds uvicorn gives the responses of a finished drain to write their last bytes


def draining_server(config: Any, drain: Callable[[asyncio.Event], Awaitable[None]]) -> Any:
    """A ``uvicorn.Server`` whose SIGTERM/SIGINT runs ``drain(now)`` on its event loop first and stops serving
    when that returns; a second signal sets ``now`` (end the wait at once). uvicorn's own handling would close
    the listening socket at once and cancel the requests still running at its deadline, streams cut off mid-way
    with a traceback each."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self) -> None:
            super().__init__(config)
            self.signals = 0  # counted by the signal handler, acted on by on_tick (on the event loop)
            self.drain_task: asyncio.Future | None = None
            self.now = asyncio.Event()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.signals += 1

        async def on_tick(self, counter: int) -> bool:
            if self.signals and self.drain_task is None:
                self.drain_task = asyncio.ensure_future(drain(self.now))
            if self.signals > 1:
                self.now.set()
            if self.drain_task is not None and self.drain_task.done():
                if not self.drain_task.cancelled() and self.drain_task.exception() is not None:
                    logging.getLogger(__name__).error("the drain failed", exc_info=self.drain_task.exception())
                self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer()


def run_serve(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    require_serve_extra()
    import uvicorn

    from nanovllm_core.gc_heap import freeze_startup_heap
    from nanovllm_core.serving.api_server import ServerSettings, build_app, check_reply_parsers
    from nanovllm_core.serving.async_llm import AsyncLLM

    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise ConfigError(f"--max-queued-requests {args.max_queued_requests}: at least 1 (leave it out for no limit)")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout {args.shutdown_timeout}: 0 seconds or more")
    check_max_request_body_bytes(args.max_request_body_bytes)
    chat_template = read_chat_template(args.chat_template)  # before the engine loads: a bad value costs nothing
    allowed_origins = read_allowed_origins(args.allowed_origins)
    check_reply_parsers(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
    resolve_model(args, overrides)  # after the checks above: with --demo it may write the demo checkpoint
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    fast, stack = front_end_stack()
    logging.getLogger(__name__).log(logging.INFO if fast else logging.WARNING, stack)
    engine = AsyncLLM.from_config(config=args.config, cli_overrides=overrides, engine_process=args.engine_process)
    settings = ServerSettings(
        served_model_name=(args.served_model_name or [args.model_path or engine.config.model])[0],
        other_model_names=tuple((args.served_model_name or [])[1:]),
        api_key=resolve_api_key(args.api_key),
        chat_template=chat_template,
        allowed_origins=allowed_origins,
        **{name: getattr(args, name) for name in SETTINGS_AS_GIVEN},
    )
    app = build_app(engine, settings)
    freeze_startup_heap()  # this process is the server's own: see nanovllm_core.gc_heap
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # the drain has ended every request by the time uvicorn shuts down: this bounds the last writes only
        timeout_graceful_shutdown=LAST_WRITES_TIMEOUT,
        timeout_keep_alive=5,
    )
    server = draining_server(config, lambda now: app.state.server.drain(args.shutdown_timeout, now))
    # with the default handlers in place, a signal between the server's end and the process's would kill it
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    print("nanovllm serve: shut down cleanly", file=sys.stderr)
    return 0
