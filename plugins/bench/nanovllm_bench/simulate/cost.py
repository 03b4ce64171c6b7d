"""The step-time model: how long one engine step takes on a GPU, from the shape of the step alone.

A step is described as the model runner records it (``ModelRunner.step_records``): its sequences ``S``, its query
tokens ``Q``, the KV tokens its attention reads ``K`` (each sequence's context, new tokens included) and the
``pairs`` of query and key its prompt chunks' causal attention computes. Prompt chunks add ``Q - S`` tokens over
one a sequence. A
step replayed from a CUDA graph (every decode step, and a step with prompt tokens of up to
``graph_max_tokens``) costs::

    ms = fixed + per_seq * S + per_kv_token * K + per_prompt_token * (Q - S) + per_prompt_pair * pairs

A larger step with prompt tokens runs eagerly: its GPU time is its kernels' time plus ``eager_per_prompt_token``
a prompt token, and no less than ``eager_floor`` (the host's time to launch its kernels one by one, which the GPU
waits for). All terms are fitted by least squares: the line over the decode steps and the graph-replayed prompt
steps, the eager terms over the steps above the graph. Without graph-replayed prompt steps in the records (a
``nanovllm bench`` run of short prompts only) the line is fitted over every step, the eager terms are zero and
``per_prompt_pair`` is the attention's matmul FLOPs at the GEMM rate the bench run measured: the first format's
model, which its calibrations keep.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from nanovllm_core.errors import ConfigError

FORMAT = "nanovllm-step-cost/2"
READABLE_FORMATS = ("nanovllm-step-cost/1", FORMAT)  # /1: no eager terms, no graph_max_tokens (both read as none)
FEATURES = ("fixed", "per_seq", "per_kv_token", "per_prompt_token")
GRAPH_LIMIT = "cuda_graph_max_mixed_tokens"  # the engine setting above which a prompt step runs eagerly
# results that do not name it (bench runs from before they did) ran with this, the engine's default then
UNNAMED_GRAPH_LIMIT = 2048
MIN_GRAPH_PROMPT_STEPS = 5  # fewer graph-replayed prompt steps than this: the first format's fit
SHIPPED_DIR = "calibrations"


@dataclass
class Calibration:
    """A fitted step-time model, its provenance and the engine facts the simulation needs (KV-cache blocks)."""

    coefficients_ms: dict[str, float]  # FEATURES -> ms, plus per_prompt_pair, eager_per_prompt_token, eager_floor
    gpu: str = "unknown"
    model: str = "unknown"
    shape: dict[str, int] = field(default_factory=dict)
    dtype: str = "unknown"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # the weights' quantization method (None: the checkpoint's dtype)
    attention: str = "unknown"
    tensor_parallel_size: int = 1
    num_kvcache_blocks: int = 4096
    kvcache_block_size: int = 256
    graph_max_tokens: int | None = None  # steps with prompt tokens above this run eagerly; None: priced alike
    host_gap_ms: float = 0.0  # the GPU's idle time between two steps (host work not hidden by async scheduling)
    frontend: dict[str, Any] = field(default_factory=lambda: {"intake_ms": 0.0, "delivery_ms": 0.0})
    commit: str = "unknown"
    date: str = "unknown"
    sources: list[str] = field(default_factory=list)
    fit: dict[str, Any] = field(default_factory=dict)
    notes: str = ""
    format: str = FORMAT

    def step_ms(
        self, seqs: int, query_tokens: int, kv_tokens: int, prompt_pairs: float = 0.0, decode_rows: int | None = None
    ) -> float:
        """A step's GPU time: ``seqs`` rows, ``query_tokens`` tokens computed, ``kv_tokens`` attended, the causal
        ``prompt_pairs`` of its prompt chunks, ``decode_rows`` of its rows with one query token (None: not known,
        priced as a step with decodes)."""
        c = self.coefficients_ms
        ms = (
            c["fixed"]
            + c["per_seq"] * seqs
            + c["per_kv_token"] * kv_tokens
            + c["per_prompt_token"] * (query_tokens - seqs)
            + c.get("per_prompt_pair", 0.0) * prompt_pairs
            + c.get("per_prompt_step", 0.0) * (query_tokens > seqs)
            + c.get("per_prompt_only_step", 0.0) * (query_tokens > seqs and decode_rows == 0)
        )
        if self.graph_max_tokens is not None and query_tokens > max(seqs, self.graph_max_tokens):
            ms = max(c.get("eager_floor", 0.0), ms + c.get("eager_per_prompt_token", 0.0) * (query_tokens - seqs))
        return ms

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> Calibration:
        if data.get("format") not in READABLE_FORMATS:
            raise ConfigError(
                f"{where}: not a step-cost calibration (format {data.get('format')!r}, expected one of "
                f"{', '.join(READABLE_FORMATS)})"
            )
        missing = [f for f in FEATURES if f not in data.get("coefficients_ms", {})]
        if missing:
            raise ConfigError(f"{where}: coefficients_ms lacks {missing}")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def shipped_calibrations() -> list[str]:
    """Names of the calibrations that ship with the package (``h200-qwen3-0.6b-bf16``...)."""
    folder = resources.files("nanovllm_bench.simulate") / SHIPPED_DIR
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_calibration(name_or_path: str) -> Calibration:
    """A calibration by shipped name or from a JSON file; an unknown one raises ConfigError listing the shipped."""
    path = Path(name_or_path)
    if path.is_file():
        text, where = path.read_text(), str(path)
    else:
        shipped = shipped_calibrations()
        if name_or_path not in shipped:
            raise ConfigError(
                f"--calibration {name_or_path!r} is neither a file nor a shipped calibration; shipped: "
                f"{', '.join(shipped)}"
            )
        text = (resources.files("nanovllm_bench.simulate") / SHIPPED_DIR / f"{name_or_path}.json").read_text()
        where = f"calibration {name_or_path}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    return Calibration.from_dict(data, where)


RECORD_COLUMNS = 7  # S, Q, K, ms, pairs, the longest context, rows of one query token


def records_tensor(records: list[tuple]) -> Any:
    """``(S, Q, K, ms[, pairs[, longest[, one-token rows]]])`` step records as a float64 tensor of seven columns,
    NaN where a record lacks a column (from a runner that did not record it): see :func:`record_pairs` and
    :func:`prompt_only_steps`."""
    import torch

    n = RECORD_COLUMNS
    rows = [tuple(r[:n]) + (float("nan"),) * (n - len(r[:n])) for r in records]
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, n)


def prompt_only_steps(records: Any) -> Any:
    """Which :func:`records_tensor` rows are steps of prompt chunks alone, no decode beside them (``fifo``'s prompt
    steps); False where the runner did not record its rows of one query token."""
    s, q, decodes = records[:, 0], records[:, 1], records[:, 6]
    return (q > s) & (decodes == 0)


def record_pairs(records: Any) -> Any:
    """Causal prompt attention's query-key pairs of :func:`records_tensor` rows: the fifth column where the
    runner recorded it (exact), else estimated from the step's shape, which does not say how its tokens split
    among its sequences: a pure prefill (``K == Q``) as ``S`` equal prompts (exact for one), any other step with
    prompt tokens as one chunk of ``Q - S + 1`` tokens from the start of its prompt (a lower bound: a chunk deep
    into a long prompt attends to every token before it)."""
    import torch

    s, q, k, recorded = records[:, 0], records[:, 1], records[:, 2], records[:, 4]
    chunk = q - s + 1
    pairs = torch.where(k == q, q * q / (2 * s) + q / 2, chunk * (chunk + 1) / 2)
    estimated = torch.where(q > s, pairs, torch.zeros_like(q))
    return torch.where(torch.isnan(recorded), estimated, recorded)


def predict_records(coef: dict[str, float], graph_max_tokens: int | None, records: Any) -> Any:
    """:meth:`Calibration.step_ms` of each row of a :func:`records_tensor`."""
    import torch

    s, q, k = records[:, 0], records[:, 1], records[:, 2]
    ms = (
        coef["fixed"]
        + coef["per_seq"] * s
        + coef["per_kv_token"] * k
        + coef["per_prompt_token"] * (q - s)
        + coef.get("per_prompt_pair", 0.0) * record_pairs(records)
        + coef.get("per_prompt_step", 0.0) * (q > s).double()
        + coef.get("per_prompt_only_step", 0.0) * prompt_only_steps(records).double()
    )
    if graph_max_tokens is None:
        return ms
    eager = (q > s) & (q > graph_max_tokens)
    priced = torch.clamp(ms + coef.get("eager_per_prompt_token", 0.0) * (q - s), min=coef.get("eager_floor", 0.0))
    return torch.where(eager, priced, ms)


def fit_quality(coef: dict[str, float], graph_max_tokens: int | None, records: list[tuple]) -> dict[str, Any]:
    """r2 and mean absolute error (%) of the model over all records, the decode steps and the prompt steps."""
    import torch

    data = records_tensor(records)
    y, predicted = data[:, 3], predict_records(coef, graph_max_tokens, data)
    prompt = data[:, 1] > data[:, 0]

    def r2(mask: torch.Tensor) -> float | None:
        spread = float(((y[mask] - y[mask].mean()) ** 2).sum())
        return 1 - float(((y[mask] - predicted[mask]) ** 2).sum()) / spread if int(mask.sum()) > 1 and spread else None

    def mae(mask: torch.Tensor) -> float | None:
        return float(100 * ((predicted[mask] - y[mask]).abs() / y[mask]).mean()) if bool(mask.any()) else None

    return {
        "r2": r2(torch.ones_like(prompt)),
        "r2_decode_steps": r2(~prompt),
        "r2_prompt_steps": r2(prompt),
        "decode_steps_mean_abs_error_pct": mae(~prompt),
        "prompt_steps_mean_abs_error_pct": mae(prompt),
    }


def fit_records(
    records: list[tuple], graph_max_tokens: int | None = None, pair_ms: float = 0.0
) -> tuple[dict[str, float], dict[str, Any]]:
    """Least squares of the step model over ``(S, Q, K, ms[, pairs])`` records: its coefficients (ms) and the fit's
    quality, with the graph limit it priced (``graph_max_tokens``: None where the records hold too few
    graph-replayed prompt steps to tell eager steps apart, and the first format's line is fitted over every step).
    ``pair_ms``: the price of a prompt pair where it cannot be fitted (FLOPs at the GEMM rate)."""
    import torch

    if len(records) < len(FEATURES) + 1:
        raise ConfigError(f"{len(records)} step records: a fit needs at least {len(FEATURES) + 1}")
    data = records_tensor(records)
    s, q, k, y = data[:, 0], data[:, 1], data[:, 2], data[:, 3]
    prompt = q > s
    if not bool(prompt.any()):
        raise ConfigError("the step records hold no step with prompt tokens: the prompt cost cannot be fitted")
    eager = prompt & (q > graph_max_tokens) if graph_max_tokens is not None else torch.zeros_like(prompt)
    if int((prompt & ~eager).sum()) < MIN_GRAPH_PROMPT_STEPS:
        graph_max_tokens, eager = None, torch.zeros_like(prompt)
    line = ~eager
    pairs = record_pairs(data)
    columns = [torch.ones_like(s), s, k, q - s]
    fit_pairs = graph_max_tokens is not None
    alone = prompt_only_steps(data)
    # a term of its own for prompt steps without decodes, where the records say which they are and hold enough
    # graph-replayed steps of both kinds to tell it from the prompt-step term
    fit_alone = fit_pairs and all(
        int((kind & prompt & ~eager).sum()) >= MIN_GRAPH_PROMPT_STEPS for kind in (alone, ~alone)
    )
    step_terms = [prompt.double(), alone.double()] if fit_alone else [prompt.double()]
    x = torch.stack(columns + [*step_terms, pairs] if fit_pairs else columns, dim=1)
    coef_t = _least_squares(x[line], y[line])
    if fit_pairs and float(coef_t[-1]) <= 0:  # no measurable attention cost: price it at the GEMM rate instead
        fit_pairs, x = False, x[:, :-1]
        coef_t = _least_squares(x[line], (y - pair_ms * pairs)[line])
    coef = dict(zip(FEATURES, (float(c) for c in coef_t[: len(FEATURES)])))
    coef["per_prompt_pair"] = float(coef_t[-1]) if fit_pairs else pair_ms
    if graph_max_tokens is not None:
        coef["per_prompt_step"] = float(coef_t[len(FEATURES)])
    if fit_alone:
        coef["per_prompt_only_step"] = float(coef_t[len(FEATURES) + 1])
    if bool(eager.any()):
        coef["eager_per_prompt_token"], coef["eager_floor"] = _fit_eager(
            (x[eager] @ coef_t) + (0.0 if fit_pairs else pair_ms * pairs[eager]), (q - s)[eager], y[eager]
        )
    quality = {
        "graph_max_tokens": graph_max_tokens,
        "records": len(records),
        "decode_steps": int((~prompt).sum()),
        "prompt_steps": int(prompt.sum()),
        "eager_prompt_steps": int(eager.sum()),
        **fit_quality(coef, graph_max_tokens, records),
        "largest_decode_batch": int(s[~prompt].max()) if bool((~prompt).any()) else 0,
        "largest_kv_tokens": int(k.max()),
        "prompt_tokens_per_prompt_step": [int((q - s)[prompt].min()), int((q - s)[prompt].max())],
    }
    return coef, quality


def _least_squares(x: Any, y: Any) -> Any:
    """``x @ coef ~ y``, each column scaled to a unit maximum first (pairs run to millions, the intercept is 1)."""
    import torch

    scale = x.abs().amax(dim=0).clamp(min=1e-12)
    return torch.linalg.lstsq(x / scale, y.unsqueeze(1), driver="gelsd").solution.squeeze(1) / scale


def _fit_eager(base: Any, tokens: Any, y: Any) -> tuple[float, float]:
    """``max(floor, base + per_token * tokens)`` over the eager steps: the floor is the mean time of the steps it
    bounds (their kernels take less than the host's launches: their times do not grow with their tokens), the
    per-token term a least squares of the relative error over the others; alternated until the split settles."""

    floor, extra, bound = float(y.mean()), 0.0, None
    for _ in range(100):
        now = base + extra * tokens < floor
        if bound is not None and bool((now == bound).all()):
            break
        bound = now
        floor = float(y[bound].mean()) if bool(bound.any()) else 0.0
        if bool((~bound).any()):
            t, r = tokens[~bound] / y[~bound], (y - base)[~bound] / y[~bound]
            extra = max(0.0, float((t * r).sum() / (t**2).sum()))
    return extra, floor


def _shape_of(model: str) -> tuple[str, dict[str, int]]:
    """The model shape of a ``nanovllm bench`` run: a ``--shape`` named in the checkpoint path, or its config.json."""
    from nanovllm_bench.offline import SHAPES

    for name in sorted(SHAPES, key=len, reverse=True):
        if re.search(rf"(^|[-_/]){re.escape(name)}([-_/]|$)", model):
            s = SHAPES[name]
            return name, {k: s[k] for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size")}
    config = Path(model) / "config.json"
    if config.is_file():
        c = json.loads(config.read_text())
        heads = c["num_attention_heads"]
        return Path(model).name, {
            "num_layers": c["num_hidden_layers"],
            "num_heads": heads,
            "num_kv_heads": c.get("num_key_value_heads") or heads,
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
            "hidden_size": c["hidden_size"],
        }
    raise ConfigError(
        f"model {model!r}: its shape is unknown (neither a bench --shape name, {', '.join(SHAPES)}, in its path "
        "nor a checkpoint folder with a config.json here)"
    )


FRONTEND_METRICS = {  # the front-end's own part, then the hop to the engine; then the outputs' way back
    "frontend_ms": "request_frontend_time_seconds",
    "hop_ms": "request_intake_time_seconds",
    "delivery_ms": "output_delivery_lag_seconds",
}


def _metric_totals(path: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--frontend-metrics {path}: cannot read it ({exc})") from None
    for line in lines:
        match = re.match(r"^nanovllm:(\w+?)_(sum|count)(?:\{[^}]*\})? (\S+)$", line)
        if match and match.group(1) in FRONTEND_METRICS.values():
            totals[f"{match.group(1)}_{match.group(2)}"] = float(match.group(3))
    return totals


def frontend_from_metrics(paths: list[str]) -> dict[str, Any]:
    """The front-end's mean time per request beside the engine's steps, from ``nanovllm serve``'s /metrics text:
    the intake is ``request_frontend_time`` (HTTP request to the hand-over: body, validation, tokenization) plus
    ``request_intake_time`` (the hand-over to the engine's arrival), and ``output_delivery_lag`` (a step's output
    to its stream) the delivery. With two files, the second is the same server's earlier scrape, subtracted (one
    benchmark's share)."""
    if len(paths) not in (1, 2):
        raise ConfigError("--frontend-metrics takes one /metrics file, or two (after, then before) of one server")
    after = _metric_totals(paths[0])
    before = _metric_totals(paths[1]) if len(paths) == 2 else {}
    frontend: dict[str, Any] = {}
    for key, name in FRONTEND_METRICS.items():
        if f"{name}_count" not in after:
            raise ConfigError(
                f"--frontend-metrics {paths[0]}: no nanovllm:{name} histogram (a nanovllm serve /metrics scrape)"
            )
        count = after[f"{name}_count"] - before.get(f"{name}_count", 0.0)
        total = after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)
        if count <= 0:
            raise ConfigError(f"--frontend-metrics: no {name} observations between the two scrapes")
        frontend[key] = 1e3 * total / count
    frontend["intake_ms"] = frontend["frontend_ms"] + frontend["hop_ms"]
    frontend["source"] = " minus ".join(Path(p).name for p in paths)
    return frontend


def _ms_per_request_and_per_1k_tokens(points: list[tuple[float, float]]) -> tuple[float, float]:
    """The median line through ``(prompt tokens / 1000, ms)`` points (least absolute deviations, by iteratively
    reweighted least squares): its fixed part and its slope, neither below zero (a negative slope is noise: longer
    prompts cost no less). Not the least-squares line: the requests of a burst queue in the front-end for
    milliseconds, which would move a mean; the simulator charges each request the typical time."""
    weights = [1.0] * len(points)
    fixed = per_1k = 0.0
    for _ in range(100):
        total = sum(weights)
        mean_x = sum(w * x for w, (x, _) in zip(weights, points)) / total
        mean_y = sum(w * y for w, (_, y) in zip(weights, points)) / total
        spread = sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points))
        slope = sum(w * (x - mean_x) * (y - mean_y) for w, (x, y) in zip(weights, points)) / spread if spread else 0.0
        slope = max(slope, 0.0)
        step = abs(slope - per_1k) + abs(mean_y - slope * mean_x - fixed)
        fixed, per_1k = mean_y - slope * mean_x, slope
        if step < 1e-9:
            break
        weights = [1.0 / max(abs(y - fixed - per_1k * x), 1e-6) for x, y in points]
    return max(fixed, 0.0), per_1k


def frontend_from_timelines(paths: list[str], pipe: tuple[float, float] | None = None) -> dict[str, Any]:
    """The front-end's time per request from ``nanovllm serve --request-timeline`` files, and the median from the
    engine reading a first token to the front-end having it (the output hand-over).

    The intake is the front-end's own part, from the HTTP request to the hand-over to the engine, fitted as a fixed
    part plus a part per prompt token (the median line: a long prompt's body, validation and tokenization cost more),
    plus the hop to the engine process. A hop stamped under load also holds the wait for the running step to end,
    which the simulated engine adds itself (it admits a request at its next step), so the hop counted is ``pipe``
    when given (ms and ms per 1k prompt tokens: an idle server's, :func:`pipe_from_timings`), else the lower decile
    of the timelines' hops, the nearest they come to the pipe alone. Timelines without a hand-over stamp are fitted
    from the HTTP request to the engine's arrival, as they are."""
    intake: list[tuple[float, float]] = []  # (prompt tokens / 1000, ms)
    hops: list[float] = []
    delivery: list[float] = []
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"--request-timelines {path}: cannot read it ({exc})") from None
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except ValueError:
                raise ConfigError(f"--request-timelines {path}:{number}: not a JSON line") from None
            if "clock" in record:  # a server's first line: the clock the stamps are on
                continue
            try:
                if record.get("handed") is None:
                    seconds = record["engine_arrival"] - record["received"]
                else:
                    seconds = record["handed"] - record["received"]
                    hops.append(1e3 * max(0.0, record["engine_arrival"] - record["handed"]))
                intake.append((record["num_prompt_tokens"] / 1e3, 1e3 * seconds))
                if record.get("first_token") is not None and record.get("first_token_delivered") is not None:
                    delivery.append(1e3 * (record["first_token_delivered"] - record["first_token"]))
            except (KeyError, TypeError):
                raise ConfigError(
                    f"--request-timelines {path}:{number}: not a request's timeline (nanovllm serve --request-timeline)"
                ) from None
    if not intake:
        raise ConfigError(f"--request-timelines {' '.join(paths)}: no request in them")
    fixed, per_1k = _ms_per_request_and_per_1k_tokens(intake)
    hop, hop_per_1k = pipe if pipe is not None else (sorted(hops)[len(hops) // 10] if hops else 0.0, 0.0)
    return {
        "intake_ms": fixed + hop,
        "intake_ms_per_1k_prompt_tokens": per_1k + hop_per_1k,
        "hop_ms": hop,
        "hop_ms_per_1k_prompt_tokens": hop_per_1k,
        "hop_source": "an idle server's" if pipe is not None else "the lower decile under load",
        "delivery_ms": statistics.median(delivery) if delivery else 0.0,
        "requests": len(intake),
        "source": " ".join(Path(p).name for p in paths),
    }


def _idle_line(paths: list[str], figure: Callable[[dict[str, Any]], float]) -> tuple[float, float]:
    """A line over the prompt length (ms, ms per 1k prompt tokens) through ``figure`` of each prompt length of
    ``benchmarks/request_timeline.py --json`` files."""
    points: list[tuple[float, float]] = []  # (prompt tokens / 1000, ms)
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            for kind in ("long", "short"):
                if kind in data:
                    points.append((data[kind]["prompt_tokens"] / 1e3, figure(data[kind])))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--client-timings {path}: not a request_timeline.py --json file ({exc})") from None
    if not points:
        raise ConfigError(f"--client-timings {' '.join(paths)}: no prompt's timings in them")
    return _ms_per_request_and_per_1k_tokens(points)


# what client_from_timings adds from a file's front-end CPU probe: with them the simulator queues the front-end
FRONTEND_CPU_KEYS = ("cpu_ms_per_request", "cpu_prompt_tokens", "output_cpu_ms_per_token", "output_cpu_ms_per_step",
                     "cpu_source")  # fmt: skip


def client_from_timings(paths: list[str]) -> dict[str, Any]:
    """The client's part of a first token's time, outside the server (the request's way in, the reply's way out),
    from ``benchmarks/request_timeline.py --json`` files: each prompt length's client-seen first token less the
    server's receipt-to-hand-over, a line over the prompt lengths (a fixed part and a part per 1k prompt tokens).
    Where a file also measured the front-end's CPU (``--cpu-requests``), its CPU a request and a streamed token too:
    the simulator then queues every request's and token's work on the front-end (``simulate.frontend``)."""
    fixed, per_1k = _idle_line(paths, lambda figures: figures["outside_server_ms"])
    client = {"client_ms": fixed, "client_ms_per_1k_prompt_tokens": per_1k,
              "client_source": " ".join(Path(p).name for p in paths)}  # fmt: skip
    for path in paths:
        cpu = json.loads(Path(path).read_text()).get("frontend_cpu")
        if cpu:
            client.update(cpu_ms_per_request=cpu["ms_per_request"], cpu_prompt_tokens=cpu["prompt_tokens"],
                          output_cpu_ms_per_token=cpu["ms_per_output_token"], cpu_source=Path(path).name)  # fmt: skip
            if "ms_per_step" in cpu:
                client["output_cpu_ms_per_step"] = cpu["ms_per_step"]
            break
    return client


def frontend_from_idle(paths: list[str]) -> dict[str, Any]:
    """The front-end's time per request from an idle server alone (``request_timeline.py --json`` files' stages):
    a line over the prompt length through the HTTP request to the hand-over, plus the pipe to the engine, and the
    mean hand-over of a first token back. With nothing queued the medians are the work itself, so a calibration
    fitted this way holds no load of any workload."""
    fixed, per_1k = _idle_line(
        paths, lambda f: f["stages_ms"]["received -> validated"] + f["stages_ms"]["validated -> handed"]
    )
    hop, hop_per_1k = _idle_line(paths, lambda f: f["stages_ms"]["handed -> engine_arrival"])
    back = [
        figures["stages_ms"]["first_token -> first_token_delivered"]
        for path in paths
        for kind, figures in json.loads(Path(path).read_text()).items()
        if kind in ("long", "short")
    ]
    return {
        "intake_ms": fixed + hop, "intake_ms_per_1k_prompt_tokens": per_1k + hop_per_1k, "hop_ms": hop,
        "hop_ms_per_1k_prompt_tokens": hop_per_1k, "hop_source": "an idle server's",
        "delivery_ms": statistics.fmean(back), "source": " ".join(Path(p).name for p in paths),
    }  # fmt: skip


def pipe_from_timings(paths: list[str]) -> tuple[float, float] | None:
    """The hop from the front-end's hand-over to the engine's arrival on an idle server, where no step is running
    to wait for (``request_timeline.py --json`` files' stages): ms and ms per 1k prompt tokens, the prompt's ids
    crossing the process boundary; None if the files predate the stages."""
    try:
        return _idle_line(paths, lambda figures: figures["stages_ms"]["handed -> engine_arrival"])
    except ConfigError:
        return None


def calibrate(
    paths: list[str],
    commit: str | None = None,
    date: str | None = None,
    frontend: dict[str, Any] | None = None,
    client: dict[str, Any] | None = None,
) -> Calibration:
    """Fit a calibration from ``nanovllm bench --json`` results of one GPU, model shape and KV dtype.

    ``commit`` and ``date`` (of the bench run) are taken from the results when they carry them, else from here;
    ``frontend`` (:func:`frontend_from_metrics` or :func:`frontend_from_timelines`): the serving front-end's time
    per request, else none; ``client`` (:func:`client_from_timings`): the client's way in and out, added to it."""
    if not paths:
        raise ConfigError("--calibrate needs at least one nanovllm bench --json result")
    results = []
    for p in paths:
        try:
            results.append(json.loads(Path(p).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--calibrate {p}: cannot read a bench JSON ({exc})") from None
    records: list[tuple] = []
    for p, r in zip(paths, results):
        if not r.get("step_records"):
            raise ConfigError(
                f"--calibrate {p}: no step_records (run nanovllm bench on a CUDA GPU with --json: it times each step)"
            )
        records += [tuple(rec) for rec in r["step_records"]]  # type: ignore[misc]
    first = results[0]
    for key in ("device", "model", "kv_cache_dtype", "quantization", "dtype", "tensor_parallel_size"):
        values = {str(r.get(key)) for r in results}
        if len(values) > 1:
            raise ConfigError(f"--calibrate: the bench results differ in {key} ({sorted(values)}): fit one at a time")
    shape_name, shape = _shape_of(first["model"])
    gemm = first.get("gemm_flop_per_s")
    flops_per_pair = 4 * shape["num_layers"] * shape["num_heads"] * shape["head_dim"]  # QK^T and PV
    pair_ms = 1e3 * flops_per_pair / (gemm * first.get("tensor_parallel_size", 1)) if gemm else 0.0
    graph_max = int(first[GRAPH_LIMIT] if first.get(GRAPH_LIMIT) is not None else UNNAMED_GRAPH_LIMIT)
    coef, quality = fit_records(records, graph_max, pair_ms)
    graph_max_tokens = quality["graph_max_tokens"]
    quality["per_source"] = {
        Path(p).name: fit_quality(coef, graph_max_tokens, r["step_records"]) for p, r in zip(paths, results)
    }
    notes = (
        f"Fitted from {quality['decode_steps']} decode steps (up to {quality['largest_decode_batch']} sequences, "
        f"{quality['largest_kv_tokens']:,} KV tokens a step) and {quality['prompt_steps']} steps with prompt "
        f"tokens ({quality['prompt_tokens_per_prompt_step'][0]:,}-{quality['prompt_tokens_per_prompt_step'][1]:,} "
        "prompt tokens each"
    )
    if graph_max_tokens is not None:
        notes += (
            f", {quality['eager_prompt_steps']} of them above the {graph_max_tokens:,}-token CUDA graphs, eager). "
            "Prompt attention (per_prompt_pair) is fitted on graph-replayed prompt steps; longer prompts than "
            "the records hold are extrapolated along it."
        )
    else:
        notes += (
            "). Too few steps with prompt tokens replay a CUDA graph to price eager steps apart: smaller prompt "
            "steps are extrapolated along the fitted line; causal prompt attention (per_prompt_pair) is the "
            "attention's FLOPs at the measured GEMM rate, not fitted."
        )
        if not gemm:
            notes += " The bench result has no GEMM rate: prompt attention beyond the fitted line is not modeled."
    steps = first.get("steps") or 0
    host_gap = 1e3 * first["gpu_idle_s"] / steps if steps and first.get("gpu_idle_s") is not None else 0.0
    dtype = str(first.get("dtype", "unknown")).replace("torch.", "")
    return Calibration(
        coefficients_ms=coef,
        gpu=str(first.get("device", "unknown")),
        model=shape_name,
        shape=shape,
        dtype=dtype,
        kv_cache_dtype=str(first.get("kv_cache_dtype", "auto")),
        quantization=first.get("quantization"),
        attention=str(first.get("attention", "unknown")),
        tensor_parallel_size=int(first.get("tensor_parallel_size", 1)),
        num_kvcache_blocks=int(first.get("num_kvcache_blocks") or 4096),
        graph_max_tokens=graph_max_tokens,
        host_gap_ms=host_gap,
        frontend={**(frontend or {"intake_ms": 0.0, "delivery_ms": 0.0, "source": "none given"}), **(client or {})},
        commit=str(first.get("commit") or commit or "unknown"),
        date=str(first.get("date") or date or "unknown"),
        sources=[Path(p).name for p in paths],
        fit=quality,
        notes=notes,
    )
