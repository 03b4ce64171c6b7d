"""The scheduler policies served in turn, on the workloads where the choice matters, at a few loads.

    python benchmarks/policies.py                                  # fifo, mixed, priority; every workload
    python benchmarks/policies.py --workloads long-prompts --loads 0.7
    python benchmarks/policies.py --dry-run                        # the commands, nothing run
    python benchmarks/policies.py --policies mixed --workloads long-docs --saturation long-docs=47.2   # rerun one

For each policy, one ``nanovllm serve`` on 127.0.0.1 (Qwen3-0.6B shape, random weights, ``triton``; ``mixed`` and
``priority`` with ``--step-tokens`` tokens a step, so that every step with prompt tokens replays a CUDA graph), and
against it, for each workload, ``nanovllm bench serve`` at each load. Every request carries one of two priority
classes in turn (``--priorities 0,1``: class 0 is the urgent one); ``fifo`` and ``mixed`` ignore them, and the
results report both classes for every policy.

Workloads:

- ``long-prompts``: vLLM's random dataset, prompts of 2,250-3,750 tokens, 192-320 output tokens. ``fifo`` runs
  waiting prompts in prompt-only steps, so running requests wait for them; this is where ``mixed`` pays.
- ``nano``: nano-vllm's benchmark (prompts and outputs of 100-1,024 tokens), 512 requests.
- ``sharegpt-synth``: a ShareGPT-like length mix (short prompts and outputs with long tails), 1,000 requests.
- ``long-docs``: long documents among chat turns: sharegpt-synth's 1,000 lengths where every 20th request is a
  document of 8,192-32,768 prompt tokens and 128-512 output tokens (a trace file, ``long-docs.jsonl`` in the
  results folder; the servers then take ``--max-model-len 40960``). Where ``fifo``'s long prompt steps stall the
  chat turns' decodes.
- ``held-out-agents``: **held out: fitted on nothing.** Multi-turn agent sessions (``held-out-agents.jsonl`` in
  the results folder, from :func:`agent_sessions`, seed 0): each request's prompt is its session's context so far,
  token for token the previous turn's prompt plus stand-ins for that turn's output and a tool result, after a
  system prompt shared by every session of the same agent; prompts of 1-4k tokens, mostly prefix-cache hits of
  growing length, outputs of 16-128 tokens, and a quarter of the turns a burst of 2-4 requests on one context.
  Written before any calibration saw it, so that the simulator's validation has one workload it was
  not tuned to: no calibration is fitted on it or chosen by it (``calibrate.py`` refuses it, and so does
  ``--step-records`` here), and its simulated-against-measured rows are reported as they come.
- ``held-out-reasoning``: **held out: fitted on nothing**, as ``held-out-agents`` and for the same reason, written
  after that one was read on the GPU and before any calibration refitted since (``held-out-reasoning.jsonl``, from
  :func:`reasoning_requests`, seed 0): 300 questions of 32-768 tokens after one 256-token instruction every
  request shares, each answered at length, 256-4,096 output tokens (uniform in their logarithm): decode steps over
  long and growing contexts, which none of the other workloads keeps up.
- ``held-out-classify``: **held out: fitted on nothing**, as the two before it, written after ``held-out-reasoning``
  was read and before the next refit (``held-out-classify.jsonl``, from :func:`classify_requests`, seed 0):
  2,000 short requests, each one of four tasks' few-shot instructions (384-768 tokens, shared by every request of
  its task: prefix-cache hits) and an input of 16-256 tokens of its own, answered with 1-8 tokens: each a short
  prompt step and a token or a few, so the front-end's time per request and its queue set the latency more than
  in any other workload.
- ``held-out-extract``: **held out: fitted on nothing**, as the three before it, written after
  ``held-out-classify`` was read and before the front-end's CPU was first measured for a calibration
  (``held-out-extract.jsonl``, from :func:`extract_requests`, seed 0): 1,500 requests, each one of three
  extraction schemas (an instruction of 256-512 tokens, shared by every request of its schema) and a document of
  128-1,024 tokens, answered with 24-160 tokens: many requests a second, each streaming tens of tokens, so the
  front-end's time per streamed token weighs as its time per request does.
- ``held-out-rag``: **held out: fitted on nothing**, as the four before it, written after ``held-out-extract`` was
  read and the engine's CUDA graphs grew to 8,192-token prompt steps, before any refit since
  (``held-out-rag.jsonl``, from :func:`rag_requests`, seed 0): 600 questions over retrieved passages, each prompt
  one system prompt every request shares (192-256 tokens), 3-8 passages of 256-768 tokens drawn from a pool of
  200 (the popular ones more often, so a prompt's first passage is often another's too) and a question of 16-64
  tokens, answered with 32-384 tokens: prompts of about 1,100-5,000 tokens, mostly computed afresh, whose prompt
  steps fall between the old and the new graph limit.

Loads are fractions of the workload's saturation rate: the request rate of the first policy's server with every
request sent at once (``fifo``'s by default), so every policy sees the same arrival rates, or the rate
``--saturation WORKLOAD=REQ_PER_S`` gives (an earlier run's, so that a policy run again gets its rates); ``inf``
sends every request at once. ``summary.json`` is written after each policy, so a run cut short keeps what it
measured. ``priority`` also gets an idle run (``--idle-prompts`` requests at 2 req/s), the baseline for its
urgent class's time to first token.

Results go to RESULTS_DIR/policies/: POLICY_WORKLOAD.json (``nanovllm bench serve``'s, one run per load),
saturation_WORKLOAD.json, each server's log and /metrics (with ``--step-records``, steps_POLICY.json: every step's
shape and GPU time; with ``--request-timelines``, timeline_POLICY.jsonl: every request's timeline), and
summary.json with the GPU, date and commit; the script ends with table rows in docs/performance.md's format.
"""

from __future__ import annotations

import argparse
import inspect
import shlex
import sys
from pathlib import Path
from typing import Any

from _common import (
    Server,
    add_client_processes_argument,
    add_common_arguments,
    add_selection_argument,
    add_server_arguments,
    bench_serve_command,
    check_cli,
    machine,
    markdown_row,
    out_dir,
    parse_numbers,
    random_checkpoint,
    read_json,
    require_positive,
    run,
    serve_command,
    shown,
    split_list,
    user_command,
    write_json,
)

POLICIES = ["fifo", "mixed", "priority"]


def installed_schedulers() -> list[str]:
    """Every scheduler policy the installed plugins register: the shipped three and any third-party one."""
    from nanovllm_core.plugins import get_registry

    return get_registry().names("scheduler")


def held_out_trace(name: str, prompts: int) -> dict[str, Any]:
    """A held-out workload's spec: fitted on nothing (see the module's docstring), its trace file ``NAME.jsonl``."""
    return {"flags": ["--dataset", "TRACE"], "saturation_prompts": prompts, "prompts": prompts,
            "trace": f"{name}.jsonl", "held_out": True}  # fmt: skip


WORKLOADS: dict[str, dict[str, Any]] = {  # bench serve flags, requests sent at once for saturation, requests a load
    "long-prompts": {
        "flags": [
            "--dataset",
            "random",
            "--random-input-len",
            "3000",
            "--random-output-len",
            "256",
            "--random-range-ratio",
            "0.25",
        ],
        "saturation_prompts": 400,
        "prompts": 600,
    },
    "nano": {"flags": ["--dataset", "nano"], "saturation_prompts": 512, "prompts": 512},
    "sharegpt-synth": {"flags": ["--dataset", "sharegpt-synth"], "saturation_prompts": 1000, "prompts": 1000},
    "long-docs": {
        "flags": ["--dataset", "TRACE"],
        "saturation_prompts": 1000,
        "prompts": 1000,
        "max_model_len": 40960,
        "trace": "long-docs.jsonl",
    },
    "held-out-agents": held_out_trace("held-out-agents", 1000),
    "held-out-reasoning": held_out_trace("held-out-reasoning", 300),
    "held-out-classify": held_out_trace("held-out-classify", 2000),
    "held-out-extract": held_out_trace("held-out-extract", 1500),
    "held-out-rag": held_out_trace("held-out-rag", 600),
}
LONG_DOCS_TRACE = WORKLOADS["long-docs"]["trace"]
AGENTS_TRACE = WORKLOADS["held-out-agents"]["trace"]
HELD_OUT = [name for name, spec in WORKLOADS.items() if spec.get("held_out")]  # never a calibration's source
MAX_MODEL_LEN = 8192  # every workload's requests fit, unless it says otherwise


def trace_file(folder: Path, workload: str) -> Path | None:
    """The trace file a trace workload's commands read (``TRACE`` in its flags), in ``folder``; None for others."""
    name = WORKLOADS[workload].get("trace")
    return None if name is None else folder / name


def parse_saturation(text: str, known: dict[str, float] | None = None) -> dict[str, float]:
    """``WORKLOAD=REQ_PER_S,...`` over ``known``: the saturation rates given instead of measured."""
    rates = dict(known or {})
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        try:
            rate = float(value)
        except ValueError:
            rate = 0.0
        if name not in WORKLOADS or not rate > 0:
            raise SystemExit(
                f"error: --saturation {item!r}: expected WORKLOAD=REQ_PER_S (a positive rate), workloads "
                f"{', '.join(WORKLOADS)}"
            )
        rates[name] = rate
    return rates


def parse_prompts(text: str) -> dict[str, int]:
    """``WORKLOAD=N,...``: how many requests each load of a workload sends, in place of its spec's ``prompts``. A
    trace workload's trace is written that long (its first requests are the same whatever the length), except
    ``long-docs``, whose trace is fixed: it takes no more than that."""
    counts = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        count = int(value) if value.isdigit() else 0
        if name not in WORKLOADS or count < 1:
            raise SystemExit(
                f"error: --prompts {item!r}: expected WORKLOAD=N (a positive count), workloads {', '.join(WORKLOADS)}"
            )
        if name in TRACE_WRITERS and not trace_grows(name) and count > WORKLOADS[name]["prompts"]:
            raise SystemExit(f"error: --prompts {item!r}: {name}'s trace holds {WORKLOADS[name]['prompts']} requests")
        counts[name] = count
    return counts


def refuse_held_out(workloads: list[str], what: str) -> None:
    """A one-line error if ``workloads`` holds a held-out workload, for ``what`` would fit a calibration on it."""
    held = [w for w in workloads if w in HELD_OUT]
    if held:
        raise SystemExit(
            f"error: {what} with {', '.join(held)}: a held-out workload is fitted on nothing; leave it out"
        )


def write_long_documents_trace(path: Path) -> None:
    """The ``long-docs`` trace: sharegpt-synth's 1,000 requests (seed 0) with every 20th (from the 11th) a long
    document; ``nanovllm simulate --dataset`` reads the same file."""
    import json
    import random

    from nanovllm_bench.serve import synthetic_sharegpt

    rng = random.Random(0)
    rows = []
    for i, chat in enumerate(synthetic_sharegpt(1000, 10000, seed=0)):
        long = i % 20 == 10
        rows.append(
            {
                "prompt_len": rng.randint(8192, 32768) if long else len(chat.prompt),
                "max_tokens": rng.randint(128, 512) if long else chat.max_tokens,
            }
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# held-out-agents: the shape of its sessions (token counts are inclusive ranges)
AGENT_KINDS = 4  # agents, each with a system prompt and tool list of its own, shared by all its sessions
AGENT_SYSTEM = (896, 1536)  # that shared prefix
AGENT_TASK = (64, 384)  # a session's task, after it
AGENT_OBSERVATION = (32, 768)  # a tool result, appended after each turn (with a stand-in for the turn's output)
AGENT_OUTPUT = (16, 128)  # a turn's output tokens: a tool call or a short answer
AGENT_CONTEXT = 4096  # a session ends before its prompt would pass this many tokens
AGENT_OPEN_SESSIONS = 16  # sessions open at once; the next request is the next turn of one of them, drawn at random
AGENT_BURST = 0.25  # the share of turns sent as a burst of AGENT_BURST_SIZE requests on one context
AGENT_BURST_SIZE = (2, 4)
AGENT_BRANCH = (8, 32)  # what tells a burst's requests apart: a short suffix of their own after the context


def agent_sessions(num_requests: int = 1000, seed: int = 0, vocab_size: int = 10000) -> list[dict[str, Any]]:
    """The ``held-out-agents`` requests, in the order sent: ``{"prompt": [ids], "max_tokens": n, "session": s,
    "turn": t}`` (``bench serve`` and ``nanovllm simulate`` read the first two and ignore the rest).

    Sessions of ``AGENT_KINDS`` agents, ``AGENT_OPEN_SESSIONS`` of them open at once; each request is the next turn
    of an open session drawn at random, and a turn's prompt is its session's context: the agent's system prompt,
    the session's task, then for every earlier turn a stand-in for its output (fresh ids, as many as it produced)
    and a tool result. So each prompt repeats the previous turn's prompt token for token (a prefix-cache hit that
    grows with the session), and sessions of one agent share its system prompt. A quarter of the turns are a
    burst: 2-4 consecutive requests on the same context, each with a short suffix of its own (parallel tool calls
    or candidates); the session goes on from the context. A session closes before its prompt would pass
    ``AGENT_CONTEXT`` tokens and a new one opens. Deterministic for ``seed``, and the first ``n`` requests are the
    same whatever ``num_requests`` is."""
    import random

    rng = random.Random(seed)

    def fresh(count: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(count)]

    def drawn(span: tuple[int, int]) -> list[int]:
        return fresh(rng.randint(*span))

    systems = [drawn(AGENT_SYSTEM) for _ in range(AGENT_KINDS)]
    sessions: list[tuple[int, int, list[int]]] = []  # the open ones: (session, turn, context)
    opened = 0
    rows: list[dict[str, Any]] = []
    while len(rows) < num_requests:
        while len(sessions) < AGENT_OPEN_SESSIONS:
            sessions.append((opened, 0, systems[rng.randrange(AGENT_KINDS)] + drawn(AGENT_TASK)))
            opened += 1
        k = rng.randrange(len(sessions))
        session, turn, context = sessions[k]
        burst = rng.randint(*AGENT_BURST_SIZE) if rng.random() < AGENT_BURST else 1
        outputs = []
        for _ in range(burst):
            prompt = context + drawn(AGENT_BRANCH) if burst > 1 else context
            outputs.append(rng.randint(*AGENT_OUTPUT))
            rows.append({"prompt": prompt, "max_tokens": outputs[-1], "session": session, "turn": turn})
        context = context + fresh(outputs[0]) + drawn(AGENT_OBSERVATION)
        if len(context) + AGENT_BRANCH[1] > AGENT_CONTEXT:
            sessions.pop(k)
        else:
            sessions[k] = (session, turn + 1, context)
    return rows[:num_requests]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """A held-out workload's requests as JSON lines, the trace ``nanovllm bench serve`` and ``nanovllm simulate``
    read."""
    import json

    path.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))


def write_agents_trace(path: Path, num_requests: int = 1000) -> None:
    """The ``held-out-agents`` trace (:func:`agent_sessions`, seed 0) as JSON lines, which ``nanovllm bench serve``
    and ``nanovllm simulate --dataset`` read."""
    write_rows(path, agent_sessions(num_requests))


# held-out-reasoning: long answers to short questions (token counts are inclusive ranges)
REASONING_INSTRUCTION = 256  # the instruction every request opens with
REASONING_QUESTION = (32, 768)
REASONING_OUTPUT = (256, 4096)  # uniform in log(tokens): a median near 1k, a tail to 4k


def reasoning_requests(num_requests: int = 300, seed: int = 0, vocab_size: int = 10000) -> list[dict[str, Any]]:
    """The ``held-out-reasoning`` requests, in the order sent: ``{"prompt": [ids], "max_tokens": n}``. Each prompt
    is one shared instruction (``REASONING_INSTRUCTION`` tokens) and a question of its own; each output length is
    drawn uniformly in its logarithm over ``REASONING_OUTPUT``. Deterministic for ``seed``, and the first ``n``
    requests are the same whatever ``num_requests`` is."""
    import math
    import random

    rng = random.Random(seed)
    instruction = [rng.randrange(vocab_size) for _ in range(REASONING_INSTRUCTION)]
    low, high = (math.log(n) for n in REASONING_OUTPUT)
    rows = []
    for _ in range(num_requests):
        question = [rng.randrange(vocab_size) for _ in range(rng.randint(*REASONING_QUESTION))]
        max_tokens = min(REASONING_OUTPUT[1], max(REASONING_OUTPUT[0], round(math.exp(rng.uniform(low, high)))))
        rows.append({"prompt": instruction + question, "max_tokens": max_tokens})
    return rows


def write_reasoning_trace(path: Path, num_requests: int = 300) -> None:
    """The ``held-out-reasoning`` trace (:func:`reasoning_requests`, seed 0) as JSON lines."""
    write_rows(path, reasoning_requests(num_requests))


def task_requests(
    num_requests: int, seed: int, vocab_size: int, tasks: int, instruction: tuple[int, int],
    own: tuple[int, int], output: tuple[int, int],
) -> list[dict[str, Any]]:
    """Requests of ``tasks`` tasks, in the order sent: ``{"prompt": [ids], "max_tokens": n}``. Each task has an
    instruction (its length drawn from ``instruction``) that opens the prompt of every request of the task; each
    request draws its task, then its own tokens (``own``) and its output length (``output``), all inclusive ranges.
    Deterministic for ``seed``, and the first ``n`` requests are the same whatever ``num_requests`` is."""
    import random

    rng = random.Random(seed)
    instructions = [[rng.randrange(vocab_size) for _ in range(rng.randint(*instruction))] for _ in range(tasks)]
    rows = []
    for _ in range(num_requests):
        task = rng.randrange(tasks)
        text = [rng.randrange(vocab_size) for _ in range(rng.randint(*own))]
        rows.append({"prompt": instructions[task] + text, "max_tokens": rng.randint(*output)})
    return rows


# held-out-classify: many short requests of a few tasks, a token or a few each (inclusive ranges)
CLASSIFY_TASKS = 4
CLASSIFY_INSTRUCTION = (384, 768)  # each task's few-shot instruction, shared by its requests
CLASSIFY_INPUT = (16, 256)
CLASSIFY_OUTPUT = (1, 8)


def classify_requests(num_requests: int = 2000, seed: int = 0, vocab_size: int = 10000) -> list[dict[str, Any]]:
    """The ``held-out-classify`` requests (:func:`task_requests`): ``CLASSIFY_TASKS`` tasks' instructions, each
    request an input of its own after one, answered in a token or a few."""
    return task_requests(num_requests, seed, vocab_size, CLASSIFY_TASKS, CLASSIFY_INSTRUCTION, CLASSIFY_INPUT,
                         CLASSIFY_OUTPUT)  # fmt: skip


def write_classify_trace(path: Path, num_requests: int = 2000) -> None:
    """The ``held-out-classify`` trace (:func:`classify_requests`, seed 0) as JSON lines."""
    write_rows(path, classify_requests(num_requests))


# held-out-extract: documents read into one of a few schemas, tens of tokens each (inclusive ranges)
EXTRACT_SCHEMAS = 3
EXTRACT_INSTRUCTION = (256, 512)  # each schema's instruction, shared by its requests
EXTRACT_DOCUMENT = (128, 1024)
EXTRACT_OUTPUT = (24, 160)


def extract_requests(num_requests: int = 1500, seed: int = 0, vocab_size: int = 10000) -> list[dict[str, Any]]:
    """The ``held-out-extract`` requests (:func:`task_requests`): ``EXTRACT_SCHEMAS`` schemas' instructions, each
    request a document of its own after one, answered in tens of tokens."""
    return task_requests(num_requests, seed, vocab_size, EXTRACT_SCHEMAS, EXTRACT_INSTRUCTION, EXTRACT_DOCUMENT,
                         EXTRACT_OUTPUT)  # fmt: skip


def write_extract_trace(path: Path, num_requests: int = 1500) -> None:
    """The ``held-out-extract`` trace (:func:`extract_requests`, seed 0) as JSON lines."""
    write_rows(path, extract_requests(num_requests))


# held-out-rag: questions over retrieved passages (inclusive ranges)
RAG_SYSTEM = (192, 256)  # the one system prompt every request opens with
RAG_POOL = 200  # passages a request's are drawn from, the k-th most popular 1/k as often as the first
RAG_PASSAGE = (256, 768)
RAG_PASSAGES = (3, 8)  # a request's passages, distinct
RAG_QUESTION = (16, 64)
RAG_OUTPUT = (32, 384)


def rag_requests(num_requests: int = 600, seed: int = 0, vocab_size: int = 10000) -> list[dict[str, Any]]:
    """The ``held-out-rag`` requests, in the order sent: ``{"prompt": [ids], "max_tokens": n}``, each the system
    prompt, its passages (``RAG_PASSAGES`` distinct ones of the pool, drawn by popularity) and a question of its
    own. Deterministic for ``seed``, and the first ``n`` requests are the same whatever ``num_requests`` is."""
    import random

    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(rng.randint(*RAG_SYSTEM))]
    pool = [[rng.randrange(vocab_size) for _ in range(rng.randint(*RAG_PASSAGE))] for _ in range(RAG_POOL)]
    popularity = [1.0 / (k + 1) for k in range(RAG_POOL)]
    rows = []
    for _ in range(num_requests):
        chosen: list[int] = []
        wanted = rng.randint(*RAG_PASSAGES)
        while len(chosen) < wanted:
            k = rng.choices(range(RAG_POOL), weights=popularity)[0]
            if k not in chosen:
                chosen.append(k)
        question = [rng.randrange(vocab_size) for _ in range(rng.randint(*RAG_QUESTION))]
        prompt = system + [t for k in chosen for t in pool[k]] + question
        rows.append({"prompt": prompt, "max_tokens": rng.randint(*RAG_OUTPUT)})
    return rows


def write_rag_trace(path: Path, num_requests: int = 600) -> None:
    """The ``held-out-rag`` trace (:func:`rag_requests`, seed 0) as JSON lines."""
    write_rows(path, rag_requests(num_requests))


TRACE_WRITERS = {
    "long-docs": write_long_documents_trace,
    "held-out-agents": write_agents_trace,
    "held-out-reasoning": write_reasoning_trace,
    "held-out-classify": write_classify_trace,
    "held-out-extract": write_extract_trace,
    "held-out-rag": write_rag_trace,
}
IDLE_RATE = 2.0


def trace_grows(workload: str) -> bool:
    """Whether ``workload``'s trace writer takes a length (``num_requests``)."""
    return "num_requests" in inspect.signature(TRACE_WRITERS[workload]).parameters


def server_command(policy: str, args: argparse.Namespace, checkpoint: str, workloads: list[str]) -> list[str]:
    flags = ["--attention", args.attention]
    max_model_len = max(WORKLOADS[w].get("max_model_len", MAX_MODEL_LEN) for w in workloads)
    if policy != "fifo":
        flags += ["--scheduler", policy, "--max-num-batched-tokens", str(args.step_tokens)]
    if args.step_records:
        flags += ["--step-records-file", str(Path(args.results_dir) / "policies" / f"steps_{policy}.json")]
    if args.request_timelines:
        flags += ["--request-timeline", str(Path(args.results_dir) / "policies" / f"timeline_{policy}.jsonl")]
    return serve_command(checkpoint, args.port, max_model_len, *flags, *shlex.split(args.engine_args))


def graph_limit(engine_args: str) -> int:
    """The servers' ``cuda_graph_max_mixed_tokens``, resolved as ``nanovllm serve`` resolves it from
    ``--engine-args`` (a flag over a ``--config`` file, TOML or vLLM's YAML, over the engine's default); the
    simulation of their runs prices steps above it as eager."""
    from nanovllm_core.cli import parse_command_line
    from nanovllm_core.cli.engine_flags import cli_overrides
    from nanovllm_core.engine.config_resolver import load_config

    args = parse_command_line(["serve", "MODEL", *shlex.split(engine_args)])
    config = load_config(args.model_path, args.config, cli_overrides(args), {})
    return config.cuda_graph_max_mixed_tokens


def client(args: argparse.Namespace, workload: str, result: Path, prompts: int, rates: str) -> list[str]:
    trace = str(trace_file(result.parent, workload))
    return bench_serve_command(
        args.port,
        result,
        *(trace if flag == "TRACE" else flag for flag in WORKLOADS[workload]["flags"]),
        "--num-prompts",
        str(prompts),
        "--rates",
        rates,
        "--priorities",
        "0,1",
        "--server-metrics",  # the server's totals after each load: its front-end's cost per rate
        processes=args.client_processes,
    )


def rates_text(loads: list[float], saturation: float | None) -> str:
    """The loads as request rates (``inf`` stays), or a placeholder naming them when saturation is not known."""
    if saturation is None:
        return "RATES(" + ",".join(f"{x:g}" for x in loads) + ")"
    return ",".join("inf" if x == float("inf") else f"{x * saturation:.1f}" for x in loads)


def summarize(
    args: argparse.Namespace,
    folder: Path,
    policies: list[str],
    workloads: list[str],
    saturation: dict[str, float],
    cmd: str,
) -> dict[str, Any]:
    rows = []
    keys = (
        "request_rate",
        "request_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "median_tpot_ms",
        "completed",
        "failed",
    )
    for policy in policies:
        for workload in workloads:
            for kind in ("idle", "loads"):
                path = folder / (f"{policy}_{workload}.json" if kind == "loads" else f"{policy}_{workload}_idle.json")
                if not path.is_file():
                    continue
                data = read_json(path)
                for r in data.get("runs", [data]):
                    row = {"policy": policy, "workload": workload, "kind": kind, **{k: r.get(k) for k in keys}}
                    rate = r.get("request_rate")
                    if kind == "idle":
                        row["load"] = "idle"
                    elif rate is None or rate == float("inf"):
                        row["load"] = "inf"
                    else:
                        row["load"] = f"{rate / saturation[workload]:.2f}" if workload in saturation else "?"
                    row["p99_ttft_ms_by_class"] = {p: c["p99_ttft_ms"] for p, c in r.get("by_priority", {}).items()}
                    rows.append(row)
    return {
        "command": cmd,
        "shape": args.shape,
        "step_tokens": args.step_tokens,
        "cuda_graph_max_mixed_tokens": graph_limit(args.engine_args),
        "saturation_req_per_s": saturation,
        **machine(),
        "rows": rows,
    }


def print_rows(summary: dict[str, Any]) -> None:
    print(
        "\nRows for docs/performance.md (workload, load | policy | TTFT p50 / p99 ms | ITL p99 ms | class 0 / 1 "
        "TTFT p99 ms | command | GPU | date | commit):"
    )
    for r in summary["rows"]:
        classes = r["p99_ttft_ms_by_class"]
        by_class = " / ".join(f"{classes[p]:.1f}" for p in sorted(classes)) if classes else ""
        load = r["load"] if r["load"] in ("idle", "inf", "?") else f"{100 * float(r['load']):.0f}%"
        print(
            markdown_row(
                [
                    f"{r['workload']}, {load} ({r['request_rate']:g} req/s)",
                    f"`{r['policy']}`",
                    f"{r['median_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f}",
                    f"{r['p99_itl_ms']:.1f}",
                    by_class,
                    f"`{summary['command']}`",
                    summary["gpu"],
                    summary["date"],
                    summary["commit"],
                ]
            )
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="fifo, mixed and priority served in turn on the workloads where the choice matters, at a few "
        "loads; results in RESULTS_DIR/policies/.",
        epilog=f"policies shipped: {', '.join(POLICIES)}; held out: {', '.join(HELD_OUT)}",
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated installed scheduler names (a third-party policy too), served in this order",
    )
    add_selection_argument(parser, "--workloads", WORKLOADS)
    parser.add_argument(
        "--loads",
        default="0.3,0.7,0.9",
        help="fractions of the saturation rate, inf for all at once (default 0.3,0.7,0.9)",
    )
    parser.add_argument("--shape", default="qwen3-0.6b", help="random-weight model shape (default qwen3-0.6b)")
    parser.add_argument("--attention", default="triton")
    parser.add_argument(
        "--step-tokens", type=int, default=2048, help="--max-num-batched-tokens of mixed and priority (default 2048)"
    )
    parser.add_argument("--engine-args", default="", metavar="FLAGS", help="more engine flags for every server")
    add_client_processes_argument(parser)
    parser.add_argument(
        "--step-records",
        action="store_true",
        help="each server times its steps on the GPU and writes them to steps_POLICY.json at exit "
        "(nanovllm simulate --calibrate reads them); refused with a held-out workload",
    )
    parser.add_argument(
        "--request-timelines",
        action="store_true",
        help="each server writes every request's timeline to timeline_POLICY.jsonl (nanovllm serve "
        "--request-timeline): where each request's time went, front-end and engine",
    )
    parser.add_argument("--idle-prompts", type=int, default=60, help="priority's idle run (0: none; default 60)")
    parser.add_argument(
        "--saturation", default="", metavar="WORKLOAD=REQ_PER_S,...",
        help="a workload's saturation rate as known (an earlier run's saturation_WORKLOAD.json), not measured: "
        "policies run again get the same arrival rates",
    )  # fmt: skip
    parser.add_argument(
        "--prompts", default="", metavar="WORKLOAD=N,...",
        help="requests each load of a workload sends, in place of its own count (a longer run steadies its tails)",
    )  # fmt: skip
    add_server_arguments(parser)
    add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    policies = split_list(args.policies, installed_schedulers(), "--policies")
    workloads = split_list(args.workloads, WORKLOADS, "--workloads")
    loads = parse_numbers(args.loads, "--loads")
    require_positive(args, "client_processes", "step_tokens")
    if args.idle_prompts < 0:
        raise SystemExit(f"error: --idle-prompts {args.idle_prompts}: 0 or more")
    if args.step_records:  # a server's step records are what calibrations are fitted on
        refuse_held_out(workloads, "--step-records")
    folder = out_dir(args.results_dir, "policies", make=not args.dry_run)
    command = user_command("benchmarks/policies.py", argv)
    checkpoint = str(random_checkpoint(args.shape, args.dry_run))
    counts = {w: WORKLOADS[w]["prompts"] for w in workloads} | parse_prompts(args.prompts)
    if not args.dry_run:
        for workload in workloads:
            if workload in TRACE_WRITERS:
                longest = max(counts[workload], WORKLOADS[workload]["saturation_prompts"])
                sized = {"num_requests": longest} if trace_grows(workload) else {}
                TRACE_WRITERS[workload](trace_file(folder, workload), **sized)
    needs_saturation = any(x != float("inf") for x in loads)
    saturation = parse_saturation(args.saturation)
    failed: list[str] = []
    for i, policy in enumerate(policies):
        server = server_command(policy, args, checkpoint, workloads)
        steps: list[tuple[str, str, list[str]]] = []  # (what, workload, command)
        for workload in workloads:
            spec = WORKLOADS[workload]
            if i == 0 and needs_saturation and workload not in saturation:
                steps.append(
                    (
                        "saturation",
                        workload,
                        client(
                            args, workload, folder / f"saturation_{workload}.json", spec["saturation_prompts"], "inf"
                        ),
                    )
                )
            if policy == "priority" and args.idle_prompts:
                steps.append(
                    (
                        "idle",
                        workload,
                        client(
                            args,
                            workload,
                            folder / f"{policy}_{workload}_idle.json",
                            args.idle_prompts,
                            f"{IDLE_RATE:g}",
                        ),
                    )
                )
            steps.append(
                (
                    "loads",
                    workload,
                    client(args, workload, folder / f"{policy}_{workload}.json", counts[workload], "LOADS"),
                )
            )
        for cmd in (server, *(c for _, _, c in steps)):
            check_cli(cmd)
        if args.dry_run:
            print(f"# {policy}\n{shown(server)} &")
            for _what, workload, cmd in steps:
                known = saturation.get(workload) if needs_saturation else 1.0
                print(shown([rates_text(loads, known) if c == "LOADS" else c for c in cmd]))
            print("(stop the server: SIGTERM)")
            continue
        with Server(server, folder / f"server_{policy}.log", args.port, args.start_timeout) as running:
            for what, workload, cmd in steps:
                if what == "loads":
                    if needs_saturation and workload not in saturation:
                        failed.append(f"{policy} {workload} (no saturation rate)")
                        continue
                    cmd = [rates_text(loads, saturation.get(workload, 1.0)) if c == "LOADS" else c for c in cmd]
                name = f"{policy}_{workload}_{what}"
                if run(cmd, folder / f"{name}.log") != 0:
                    failed.append(name)
                if what == "saturation" and (folder / f"saturation_{workload}.json").is_file():
                    saturation[workload] = read_json(folder / f"saturation_{workload}.json")["request_throughput"]
                (folder / f"metrics_{name}.txt").write_text(running.metrics())
        # after every policy: a run cut short still leaves the summary simulate_policies.py reads
        write_json(folder / "summary.json", summarize(args, folder, policies[: i + 1], workloads, saturation, command))
    if args.dry_run:
        if needs_saturation:
            print("(RATES(...): those fractions of each workload's saturation rate, measured with the first policy)")
        return 0
    summary = read_json(folder / "summary.json")
    print_rows(summary)
    if failed:
        print(f"failed: {', '.join(failed)} (see the logs in {folder})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
