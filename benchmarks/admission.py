"""Does one oversized request slow the others? Running streams' inter-token latency idle and while oversized
requests arrive, the oversized requests' answers, and the server's memory before and after (CPU is enough).

    python benchmarks/admission.py [--oversized 10] [--body-mb 50] [--streams 4] [--max-tokens 200]

``nanovllm serve --demo`` on 127.0.0.1; ``--streams`` streamed completions run twice: alone (idle), then while
``--oversized`` requests of ``--body-mb`` MB each arrive at once (half a text prompt with its Content-Length, which
the server refuses with 413 before reading it; half a text within the body limit but far longer than
``max_model_len`` tokens could be, refused with 400 before tokenization). Reports each phase's p50/p99 gap between
a stream's chunks, the oversized requests' statuses and times, and the front-end's resident memory before the
oversized requests and once they are answered. Results go to RESULTS_DIR/admission/admission.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from _common import Server, add_common_arguments, nanovllm, out_dir, write_json


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"error: no VmRSS for process {pid}")


def stream_gaps(base_url: str, max_tokens: int, gaps: list[float]) -> None:
    """One streamed completion; appends the gaps between its chunks (seconds) to ``gaps``."""
    body = json.dumps({"model": "demo", "prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()  # fmt: skip
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"content-type": "application/json"})
    last = None
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


def oversized_body(kind: str, body_bytes: int) -> bytes:
    """The request of one oversized kind, head and body, built before it is timed (a 50 MB JSON takes a while)."""
    if kind == "413":
        text = "x" * body_bytes
    else:  # within the body limit: the server's length check, not the body limit, refuses it
        text = "ab " * (body_bytes // 3)
    body = json.dumps({"model": "demo", "prompt": text, "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    return head + body


def oversized(base_url: str, kind: str, request: bytes, out: list[dict[str, Any]]) -> None:
    """Send one prepared oversized request over a raw socket (as much of it as the server reads); appends its
    status and time to ``out``."""
    host, port = base_url.removeprefix("http://").split(":")
    start = time.perf_counter()
    status = 0
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        try:
            sock.sendall(request)
        except OSError:  # the server answered and closed before reading it all
            pass
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        if reply.startswith(b"HTTP/1.1 "):
            status = int(reply[9:12])
    out.append({"kind": kind, "status": status, "seconds": time.perf_counter() - start})


def phase(base_url: str, streams: int, max_tokens: int, during: Any = None) -> list[float]:
    """``streams`` concurrent streams (and ``during``, a callable run beside them); their chunk gaps."""
    gaps: list[float] = []
    threads = [threading.Thread(target=stream_gaps, args=(base_url, max_tokens, gaps)) for _ in range(streams)]
    for t in threads:
        t.start()
    if during is not None:
        time.sleep(0.2)  # the streams are running
        during()
    for t in threads:
        t.join()
    return gaps


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else float("nan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--oversized", type=int, default=10, help="oversized requests sent at once")
    parser.add_argument("--body-mb", type=float, default=50.0, help="size of each 413 request's body, MB")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams measured in each phase")
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per stream")
    parser.add_argument("--port", type=int, default=8000)
    add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    folder = out_dir(args.results_dir, "admission", make=not args.dry_run)
    cmd = nanovllm("serve", "--demo", "--host", "127.0.0.1", "--port", str(args.port), "--device", "cpu")
    if args.dry_run:
        print(" ".join(cmd) + " &")
        print(f"{args.streams} streams idle, then beside {args.oversized} oversized requests; RSS before and after")
        return 0
    with Server(cmd, folder / "server.log", args.port) as server:
        assert server.proc is not None
        phase(server.base_url, args.streams, 20)  # warm-up
        idle = phase(server.base_url, args.streams, args.max_tokens)
        rss_before = rss_mb(server.proc.pid)
        answers: list[dict[str, Any]] = []
        limit = int(args.body_mb * 1e6)

        kinds = ["413" if i % 2 == 0 else "400" for i in range(args.oversized)]
        sizes = {"413": limit, "400": 400_000}  # the 400 kind stays within the default body limit
        requests = [oversized_body(k, sizes[k]) for k in kinds]

        def send_oversized() -> None:
            senders = [
                threading.Thread(target=oversized, args=(server.base_url, k, r, answers))
                for k, r in zip(kinds, requests)
            ]
            for t in senders:
                t.start()
            for t in senders:
                t.join()

        abused = phase(server.base_url, args.streams, args.max_tokens, send_oversized)
        time.sleep(1.0)
        rss_after = rss_mb(server.proc.pid)
    result = {
        "idle_itl_ms": {"p50": 1e3 * percentile(idle, 50), "p99": 1e3 * percentile(idle, 99)},
        "abused_itl_ms": {"p50": 1e3 * percentile(abused, 50), "p99": 1e3 * percentile(abused, 99)},
        "oversized": answers,
        "frontend_rss_mb": {"before": rss_before, "after": rss_after},
        "exit_code": server.exit_code,
    }
    write_json(folder / "admission.json", result)
    ratio = result["abused_itl_ms"]["p99"] / result["idle_itl_ms"]["p99"]
    print(f"ITL p50 / p99 ms: idle {result['idle_itl_ms']['p50']:.1f} / {result['idle_itl_ms']['p99']:.1f}, while "
          f"{args.oversized} oversized requests arrive {result['abused_itl_ms']['p50']:.1f} / "
          f"{result['abused_itl_ms']['p99']:.1f} ({ratio:.2f}x idle's p99)")
    for kind in ("413", "400"):
        mine = [a for a in answers if a["kind"] == kind]
        if mine:
            statuses = sorted({a["status"] for a in mine})
            print(f"{len(mine)} oversized ({kind} expected): statuses {statuses}, "
                  f"slowest answer {max(a['seconds'] for a in mine) * 1e3:.0f} ms")
    print(f"front-end RSS: {rss_before:.0f} MB before, {rss_after:.0f} MB after ({rss_after - rss_before:+.0f} MB); "
          f"server exit status {server.exit_code}")
    print(f"wrote {folder / 'admission.json'}")
    ok = all(a["status"] == int(a["kind"]) for a in answers) and server.exit_code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
