#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md, in two phases on one warm H200 machine (see docs/benchmarks.md):
#   bash benchmarks/gpu_session.sh triton   # Triton kernels: tests, engine parity, end-to-end bench
#   bash benchmarks/gpu_session.sh flash    # flash-attn-4: tests, kernel micro-benchmarks, end-to-end bench
# Needs PYTHONPATH with pydantic (and flash-attn-4 for phase flash). Logs and tables go to $OUT.
# The servers get uvloop and httptools (the [serve] extra's) only if their wheels are installed beside the serving
# ones; ../shared/gpu/fetch-wheels.sh does not fetch them, so add them to its serve folder once:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .gpu-wheels/serve uvloop httptools
set -u
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation --no-index -e . -e plugins/scheduler_fifo \
  -e plugins/attention_flash -e plugins/models_qwen3 -e plugins/scheduler_mixed -e plugins/scheduler_priority \
  > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee -a "$OUT/gpu.txt"
# A device call ends at its limit whatever runs then, and $OUT comes back only as the files it holds: a phase that
# overran lost its logs (r14-b). So every step's limit is cut to what is left of PHASE_BUDGET seconds (from the
# script's start, install included), a step with under 10 s left is skipped, and the logs are packed on exit.
PHASE_BUDGET=${PHASE_BUDGET:-560}
step() {  # step NAME SECONDS COMMAND...: run with a limit, keep the log, print its tail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS left=$((PHASE_BUDGET - SECONDS - 10))
  if [ "$left" -lt 10 ]; then echo "== $name: skipped, $((PHASE_BUDGET - SECONDS)) s of the phase left"; return 124; fi
  [ "$limit" -gt "$left" ] && limit=$left
  # in the background and waited for: a TERM then reaches the trap at once, not when the step ends
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 &
  wait $!
  echo "== $name: exit $? in $((SECONDS - t0)) s"; tail -n "${TAIL:-12}" "$OUT/$name.log"
}
bench() {  # bench NAME ARGS...: the nano-vllm workload through `nanovllm bench`
  local name=$1; shift
  step "bench_$name" "${BENCH_LIMIT:-200}" python -m nanovllm_core.cli bench --json "$OUT/bench_$name.json" "$@"
}
ckpt() {  # the random-weight Qwen3-0.6B checkpoint `nanovllm bench` writes (made here if no bench ran yet)
  python -c "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-0.6b', torch.bfloat16))"
}
serve_start() {  # serve_start NAME ARGS...: `nanovllm serve` on 127.0.0.1:$PORT in the background, up when /health answers
  local name=$1; shift
  # the stack uvicorn picks ("auto"): uvloop and httptools when installed (the [serve] extra's), else asyncio and h11
  python -c "import importlib.util as u; print('server $name on', 'uvloop' if u.find_spec('uvloop') else 'asyncio', \
'httptools' if u.find_spec('httptools') else 'h11')" | tee -a "$OUT/gpu.txt"
  # (TORCH_LOGS=recompiles: a torch.compile recompilation while serving shows in the log, with its cause)
  TORCH_LOGS=recompiles python -m nanovllm_core.cli serve "$(ckpt)" --port "${PORT:-8000}" --attention triton "$@" \
    > "$OUT/serve_$name.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 240); do
    python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:${PORT:-8000}/health', timeout=1)" 2>/dev/null && return 0
    sleep 0.5
  done
  echo "server $name did not come up"; tail -20 "$OUT/serve_$name.log"; kill $SERVER; return 1
}
serve_stop() { kill -TERM "$SERVER"; wait "$SERVER"; echo "== server exit $? (SIGTERM)"; }
serve_bench() {  # serve_bench NAME ARGS...: `nanovllm bench serve` against the running server
  local name=$1; shift
  step "serve_$name" "${BENCH_LIMIT:-200}" python -m nanovllm_core.cli bench serve --base-url "http://127.0.0.1:${PORT:-8000}" \
    --result-file "$OUT/serve_$name.json" "$@"
  # the server's own account after the run (step-loop busy / emit seconds, front-end CPU): where the time went
  python -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:${PORT:-8000}/metrics').read().decode())" \
    | grep -E "^(nanovllm:step_loop|process_cpu|nanovllm:generation_tokens|nanovllm:frontend_event_loop_lag|nanovllm:cuda_graph_steps|nanovllm:urgent_lane_steps|nanovllm:request_(queue|prefill|intake)_time|nanovllm:output_delivery_lag|nanovllm:num_preemptions)" \
    > "$OUT/metrics_$name.txt"
}
stages() {  # stages NAME [BEFORE]: the mean request stages and hand-overs (ms) in the server's /metrics after
  # serve_bench NAME, less those after serve_bench BEFORE (the same server's previous run: the metrics add up)
  python - "$OUT/metrics_$1.txt" ${2:+"$OUT/metrics_$2.txt"} <<'PY'
import re, sys
def read(path):
    values = {}
    for line in open(path):
        m = re.match(r"(nanovllm:[a-z_]+?)_(sum|count)\{[^}]*\} (\S+)", line)
        if m:
            values[(m[1], m[2])] = float(m[3])
    return values
after = read(sys.argv[1])
before = read(sys.argv[2]) if len(sys.argv) > 2 else {}
parts = []
for name in ("request_intake_time", "request_queue_time", "request_prefill_time", "output_delivery_lag"):
    key = f"nanovllm:{name}_seconds"
    count = after.get((key, "count"), 0) - before.get((key, "count"), 0)
    if count:
        total = after[(key, "sum")] - before.get((key, "sum"), 0)
        parts.append(f"{name} {1000 * total / count:.2f}")
print(f"== {sys.argv[1].rsplit('/', 1)[-1]}: mean ms " + ", ".join(parts))
PY
}
rate_of() {  # rate_of JSON FRACTION: FRACTION of the request throughput a `bench serve` all-at-once run measured
  python -c "import json; print(f\"{$2 * json.load(open('$1'))['request_throughput']:.1f}\")"
}
pack() {  # everything in $OUT as one logs.tgz (one file comes back where many might not), once
  [ -n "${PACKED:-}" ] && return 0
  PACKED=1
  (cd "$OUT" && tar czf /tmp/logs.tgz --exclude=logs.tgz --exclude=pip.log . && find . -maxdepth 1 -type f -delete &&
    mv /tmp/logs.tgz .)
}
trap pack EXIT
trap 'exit 143' TERM  # the call's own timeout: exit through the EXIT trap
fifo_serve_lane() {  # fifo_serve_lane N LIMIT: the fifo server all at once (nano-vllm's workload), its saturation
  # (1,000 sharegpt-synth requests at once), then N requests at each of 30/50/70/90% of it (the rates go to
  # $OUT/rates.txt for policy_lane), LIMIT seconds for that sweep
  serve_start fifo
  TAIL=14 serve_bench fifo_nano --dataset nano --request-rate inf
  TAIL=3 serve_bench fifo_sat --dataset sharegpt-synth --num-prompts 1000 --request-rate inf
  sat=$(python -c "import json; d = json.load(open('$OUT/serve_fifo_sat.json')); print(d['request_throughput'])")
  python -c "print(','.join(f'{f * $sat:.1f}' for f in (0.3, 0.5, 0.7, 0.9)))" > "$OUT/rates.txt"
  BENCH_LIMIT=$2 TAIL=3 serve_bench fifo_rates --dataset sharegpt-synth --num-prompts "$1" --rates "$(cat "$OUT/rates.txt")"
  serve_stop
}
policy_lane() {  # policy_lane N LIMIT: mixed, then priority (two classes, after an idle run), each server started at
  # once and swept at fifo's rates when fifo_serve_lane has written them: N requests per rate, LIMIT seconds a sweep
  for policy in mixed priority; do
    serve_start "$policy" --scheduler "$policy"
    for _ in $(seq 1 300); do [ -s "$OUT/rates.txt" ] && break; sleep 1; done
    extra=(); [ "$policy" = priority ] && extra=(--priorities 0,1)
    [ "$policy" = priority ] && TAIL=3 serve_bench priority_idle --dataset sharegpt-synth --num-prompts 20 \
      --request-rate 2 --priorities 0,1
    BENCH_LIMIT=$2 TAIL=3 serve_bench "${policy}_rates" --dataset sharegpt-synth --num-prompts "$1" \
      --rates "$(cat "$OUT/rates.txt")" "${extra[@]}"
    serve_stop
  done
}
summarize() {  # summarize JSON...: one line per rate of each `bench serve` result file
  python - "$@" <<'PY'
import json, sys
for path in sys.argv[1:]:
    data = json.load(open(path))
    for r in data.get("runs", [data]):
        print(f"{path.rsplit('/', 1)[-1]} rate {r['request_rate']}: {r['completed']} done in {r['duration']:.1f} s, "
              f"TTFT p50/p99 {r['median_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} ms, ITL p50/p99 "
              f"{r['median_itl_ms']:.1f}/{r['p99_itl_ms']:.1f} ms, TPOT p50 {r['median_tpot_ms']:.2f} ms")
        for p, c in r.get("by_priority", {}).items():
            print(f"    priority {p}: TTFT p50/p99 {c['median_ttft_ms']:.1f}/{c['p99_ttft_ms']:.1f} ms, "
                  f"ITL p50/p99 {c['median_itl_ms']:.1f}/{c['p99_itl_ms']:.1f} ms")
PY
}
rate_lanes() {  # rate_lanes RATES "NAME ARGS..."...: each server in turn, swept at RATES, its metrics kept
  local rates=$1; shift
  for lane in "$@"; do
    set -- $lane; local name=$1; shift
    serve_start "$name" "$@" || continue
    BENCH_LIMIT=150 TAIL=2 serve_bench "${name}_rates" --dataset sharegpt-synth --num-prompts 1000 --rates "$rates"
    serve_stop
    summarize "$OUT/serve_${name}_rates.json"
    grep -E "cuda_graph_steps|step_loop_steps_total|slow_steps|longest" "$OUT/metrics_${name}_rates.txt"
  done
}
join_lanes() { wait; cat "$OUT/lane0.txt" "$OUT/lane1.txt"; pack; }  # both lanes' logs, then everything packed
case "${1:?phase}" in
  r16-e)  # round 16, one H200 (about 2 minutes): a third fresh machine's first process, 0.6B on the FP8 cache
    TAIL=8 bench fp8_first --attention triton --kv-cache-dtype fp8 --runs 3 --warmup-prompts 1
    pack
    ;;
  r16-d)  # round 16, one H200 (about 4 minutes): r16-c's lane server again, its idle baseline from 120 requests
    # at 2 req/s (60 of class 0: r16-c's 12 a run put p99 at the largest of a dozen), then a third 70% run from four
    # client processes
    printf '[plugins]\nscheduler = "priority"\n[plugins.scheduler_options]\nurgent_priority = 0\n' > /tmp/lane.toml
    serve_start lane1024 --config /tmp/lane.toml --max-num-batched-tokens 2048 --urgent-lane-tokens 1024
    TAIL=4 serve_bench lane1024_idle120_c4 --dataset nano --num-prompts 120 --request-rate 2 --priorities 0,1 \
      --client-processes 4
    TAIL=4 serve_bench lane1024_70_c4c --dataset nano --num-prompts 512 --request-rate 33.6 --priorities 0,1 \
      --warmup 0 --client-processes 4
    serve_stop
    summarize "$OUT"/serve_*.json
    pack
    ;;
  r16-c)  # round 16, one H200 (about 7 minutes): is part of priority's class-0 tail at 70% load the load generator's?
    # One `bench serve` process reads every stream (about 19,000 chunks/s at 70% load, 35-40 us of client CPU a
    # token on the CPU box); the runs now report the client event loops' lag. r15-b's lane server (class 0 urgent,
    # 1,024 lane tokens, 2,048-token steps) idle and twice at 70% from one client process, then from four; then the
    # server without the lane from four
    printf '[plugins]\nscheduler = "priority"\n[plugins.scheduler_options]\nurgent_priority = 0\n' > /tmp/lane.toml
    nano70=(--dataset nano --num-prompts 512 --request-rate 33.6 --priorities 0,1 --warmup 0)
    idle=(--dataset nano --num-prompts 24 --request-rate 2 --priorities 0,1)
    for lane in 1024 0; do
      serve_start "lane$lane" --config /tmp/lane.toml --max-num-batched-tokens 2048 --urgent-lane-tokens $lane
      if [ "$lane" = 1024 ]; then
        TAIL=4 serve_bench "lane${lane}_idle_c1" "${idle[@]}"
        for run in a b; do TAIL=4 serve_bench "lane${lane}_70_c1$run" "${nano70[@]}"; done
      fi
      TAIL=4 serve_bench "lane${lane}_idle_c4" "${idle[@]}" --client-processes 4
      for run in a b; do TAIL=4 serve_bench "lane${lane}_70_c4$run" "${nano70[@]}" --client-processes 4; done
      serve_stop
    done
    summarize "$OUT"/serve_*.json
    python - "$OUT"/serve_*.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    d = json.load(open(path))
    print(f"{path.rsplit('/', 1)[-1]}: client loop lag mean {d.get('mean_client_loop_lag_ms', 0):.2f} p99 "
          f"{d.get('p99_client_loop_lag_ms', 0):.2f} max {d.get('max_client_loop_lag_ms', 0):.2f} ms")
PY
    pack
    ;;
  r16-b)  # round 16, one H200 (about 3 minutes): the first run again in a fresh machine's first process (r16-a: 2.7%
    # below run 2), now with the Triton kernels and torch.compile frames each run compiles and the SM clock sampled
    # every 50 ms, then a second process
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu --format=csv -lms 50 > "$OUT/clocks_first.csv" &
    SMI=$!
    TAIL=8 bench fp8_first --attention triton --kv-cache-dtype fp8 --runs 3 --warmup-prompts 1
    kill $SMI
    TAIL=8 bench fp8_second --attention triton --kv-cache-dtype fp8 --runs 3 --warmup-prompts 1
    pack
    ;;
  r16-a)  # round 16, one H200 (about 8 minutes): the warm-up whose first step fills max_num_batched_tokens. The 0.6B
    # on the FP8 cache, three runs, in the machine's first process (the first-run gap's worst case, 3.7-4.0% in
    # rounds 14-15), again in a second process, then on the bf16 cache; the new GPU tests while the 8B checkpoint is
    # written; the 8B on the FP8 cache with the SM clock and power sampled and the GEMM rate sustained for 5 s (the
    # per-step bound at the rate the power limit leaves)
    TAIL=8 bench fp8_first --attention triton --kv-cache-dtype fp8 --runs 3 --warmup-prompts 1
    TAIL=8 bench fp8_second --attention triton --kv-cache-dtype fp8 --runs 3 --warmup-prompts 1
    TAIL=8 bench bf16 --attention triton --runs 3 --warmup-prompts 1
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=8 step gpu_tests 120 python -m pytest tests/gpu/test_gpu_engine.py -m gpu -q -rf -s \
      -k "sustained or warm_up or (greedy_and_logits and triton)"
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 100 \
      > "$OUT/clocks_8b.csv" 2>&1 &
    SMI=$!
    BENCH_LIMIT=150 TAIL=8 bench 8b_fp8 --shape qwen3-8b --attention triton --kv-cache-dtype fp8 --runs 2 \
      --warmup-prompts 1 --sustained-gemm-s 5
    kill $SMI
    pack
    ;;
  r15-b)  # round 15, one H200 (about 7 minutes): the urgent lane's GPU tests; then priority (two classes, nano-vllm
    # workload, 2,048-token steps) idle and at round 8's 70% load with the lane (class 0 urgent, 1,024 lane tokens:
    # every nano-vllm prompt fits), then the same server without the lane
    TAIL=8 step gpu_tests 150 python -m pytest tests/gpu/test_gpu_urgent_lane.py -m gpu -q -rf -s
    printf '[plugins]\nscheduler = "priority"\n[plugins.scheduler_options]\nurgent_priority = 0\n' > /tmp/lane.toml
    for lane in 1024 0; do
      serve_start "priority_lane$lane" --config /tmp/lane.toml --max-num-batched-tokens 2048 --urgent-lane-tokens $lane
      TAIL=3 serve_bench "priority_lane${lane}_idle" --dataset nano --num-prompts 24 --request-rate 2 --priorities 0,1
      for run in 70 70b; do  # twice: single runs' p99 has spread 21-27 ms (round 15)
        TAIL=3 serve_bench "priority_lane${lane}_$run" --dataset nano --num-prompts 512 --request-rate 33.6 \
          --priorities 0,1 --warmup 0
      done
      stages "priority_lane${lane}_70" "priority_lane${lane}_idle"
      grep -h "urgent_lane_steps{" "$OUT/metrics_priority_lane${lane}_idle.txt" "$OUT/metrics_priority_lane${lane}_70b.txt"
      serve_stop
    done
    summarize "$OUT"/serve_*.json
    pack
    ;;
  r15-a)  # next round, one H200 (about 7 minutes): the 0.6B on the FP8 cache, three runs, in the machine's first
    # process with CUDA_MODULE_LOADING=EAGER (every kernel loaded at start-up: is the first process's extra run-1
    # time in prompt steps cuBLAS kernels loaded on first use, from a cold page cache?), then in a second process as
    # main runs; both with each run's allocator growth (pinned or device memory created in run 1?); then priority (two classes, nano-vllm workload) idle and at round 8's 70% load on uvloop and
    # httptools (the [serve] extra's stack, new in .gpu-wheels/serve), then at 70% with the server on asyncio and h11
    # (both hidden from the path while it starts; the client keeps uvloop), which every H200 server before ran on
    CUDA_MODULE_LOADING=EAGER TAIL=12 bench fp8_eager --attention triton --kv-cache-dtype fp8 --runs 3 --warmup-prompts 1
    TAIL=12 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 3 --warmup-prompts 1
    serve_start priority_uvloop --scheduler priority --max-num-batched-tokens 2048
    TAIL=3 serve_bench priority_uvloop_idle --dataset nano --num-prompts 24 --request-rate 2 --priorities 0,1
    TAIL=3 serve_bench priority_uvloop_70 --dataset nano --num-prompts 512 --request-rate 33.6 --priorities 0,1 --warmup 0
    stages priority_uvloop_70 priority_uvloop_idle
    serve_stop
    site=${PYTHONPATH%%:*}
    for m in uvloop httptools; do [ -d "$site/$m" ] && mv "$site/$m" "/tmp/$m.hidden"; done
    serve_start priority_h11 --scheduler priority --max-num-batched-tokens 2048
    # back for the client: only the server (which picked its stack at start-up) runs without them
    for m in uvloop httptools; do [ -d "/tmp/$m.hidden" ] && mv "/tmp/$m.hidden" "$site/$m"; done
    TAIL=3 serve_bench priority_h11_70 --dataset nano --num-prompts 512 --request-rate 33.6 --priorities 0,1
    stages priority_h11_70
    serve_stop
    summarize "$OUT"/serve_*.json
    pack
    ;;
  r14-c)  # round 14, one H200 (about 6 minutes): the 0.6B on the FP8 cache, three runs, with every CUDA graph replayed
    # once at start-up and without (the first run's extra time, step kind by step kind); then the priority server
    # (engine-order hand-over again) at round 8's 70% load with 2,048-token and with 512-token steps
    TAIL=12 bench fp8_replayed --attention triton --kv-cache-dtype fp8 --runs 3 --warmup-prompts 1
    cp nanovllm_core/engine/cuda_graph.py /tmp/cuda_graph.py
    sed -i '/^        graph.replay()$/d' nanovllm_core/engine/cuda_graph.py
    grep -c 'graph.replay()' nanovllm_core/engine/cuda_graph.py
    TAIL=12 bench fp8_unreplayed --attention triton --kv-cache-dtype fp8 --runs 3 --warmup-prompts 1
    cp /tmp/cuda_graph.py nanovllm_core/engine/cuda_graph.py
    for tokens in 2048 512; do
      serve_start "priority_$tokens" --scheduler priority --max-num-batched-tokens "$tokens"
      TAIL=3 serve_bench "priority_${tokens}_70" --dataset nano --num-prompts 512 --request-rate 33.6 --priorities 0,1
      stages "priority_${tokens}_70"
      serve_stop
    done
    summarize "$OUT"/serve_*.json
    pack
    ;;
  r14-a)  # round 14, one H200 (about 8 minutes; ran at 6ea8dd1 plus this phase, when main had the hand-over order): the 0.6B on the FP8 cache with nothing beside it (first run against
    # second); the 8B's decode GEMMs on cuBLAS and cuBLASLt; the 8B on the FP8 cache with the SM clock and power sampled
    # every 100 ms, then again with TORCH_BLAS_PREFER_CUBLASLT=1; the priority server idle and at round 8's 70% load
    # with first-token-first hand-over, then at 70% without it (two classes, nano-vllm workload)
    TAIL=4 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 3 --warmup-prompts 1
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=24 step gemm_8b 100 python benchmarks/decode_gemm.py --shape qwen3-8b --rows 64,128,256 \
      --blas default,cublaslt --json "$OUT/gemm_8b.json"
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    for blas in cublas cublaslt; do
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 100 \
        > "$OUT/clocks_8b_$blas.csv" 2>&1 &
      SMI=$!
      prefer=$([ "$blas" = cublaslt ] && echo 1 || echo 0)
      TORCH_BLAS_PREFER_CUBLASLT=$prefer BENCH_LIMIT=110 TAIL=4 bench "8b_fp8_$blas" --shape qwen3-8b \
        --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
      kill $SMI
    done
    serve_start priority --scheduler priority --max-num-batched-tokens 2048
    TAIL=3 serve_bench priority_idle --dataset nano --num-prompts 24 --request-rate 2 --priorities 0,1
    TAIL=3 serve_bench priority_70 --dataset nano --num-prompts 512 --request-rate 33.6 --priorities 0,1 --warmup 0
    stages priority_70 priority_idle
    serve_stop
    cp nanovllm_core/serving/async_llm.py /tmp/async_llm.py
    sed -i 's/^        if len(pairs) > 1:$/        if False:/' nanovllm_core/serving/async_llm.py
    grep -c '^        if False:$' nanovllm_core/serving/async_llm.py
    serve_start priority_engine_order --scheduler priority --max-num-batched-tokens 2048
    TAIL=3 serve_bench priority_engine_order_70 --dataset nano --num-prompts 512 --request-rate 33.6 --priorities 0,1
    stages priority_engine_order_70
    serve_stop
    cp /tmp/async_llm.py nanovllm_core/serving/async_llm.py
    summarize "$OUT"/serve_*.json
    pack
    ;;
  r13-d)  # round 13, one H200 (about 4 minutes): the RMSNorm GPU tests after their tolerance fix, then the 0.6B and
    # the 8B on the FP8 cache again (the run-to-run spread of r13-c's figures)
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=3 step gpu_tests 60 python -m pytest tests/unit/test_rms_norm_kernel.py -m gpu -q -rf
    TAIL=4 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    BENCH_LIMIT=120 TAIL=4 bench 8b_fp8 --shape qwen3-8b --attention triton --kv-cache-dtype fp8 --runs 2 \
      --warmup-prompts 1
    pack
    ;;
  r13-c)  # round 13, one H200 (about 9 minutes): the Triton RMSNorm kernel and the one-warp split merge beside the
    # SiLU kernel: GPU tests and the engine's transformers parity, the small kernels timed, then the 0.6B and the 8B
    # on the FP8 cache with all three and with none of them (round 12's state), back to back, then the bf16 caches
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=6 step gpu_tests 150 python -m pytest tests/unit/test_silu_and_mul_kernel.py tests/unit/test_rms_norm_kernel.py \
      tests/gpu/test_gpu_engine.py plugins/attention_flash/tests/test_conformance_attention.py -m gpu -q -rf \
      -k "silu or rms or greedy_and_logits or Triton or triton"
    TAIL=30 step small_kernels 60 python benchmarks/small_kernels.py
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    mkdir -p /tmp/with && cp nanovllm_core/layers/activation.py nanovllm_core/layers/norm.py \
      plugins/attention_flash/nanovllm_attention_flash/triton_kernels.py /tmp/with/
    none() {
      sed -i 's/if x.is_cuda and fused_enabled() and/if False and/' nanovllm_core/layers/activation.py \
        nanovllm_core/layers/norm.py
      sed -i 's/^        num_warps=1,$/        num_warps=4,/' plugins/attention_flash/nanovllm_attention_flash/triton_kernels.py
      grep -c "if False and" nanovllm_core/layers/activation.py nanovllm_core/layers/norm.py
    }
    all3() {
      cp /tmp/with/activation.py /tmp/with/norm.py nanovllm_core/layers/
      cp /tmp/with/triton_kernels.py plugins/attention_flash/nanovllm_attention_flash/
    }
    TAIL=4 bench fp8_new --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    none; TAIL=4 bench fp8_old --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    BENCH_LIMIT=150 TAIL=4 bench 8b_fp8_old --shape qwen3-8b --attention triton --kv-cache-dtype fp8 --runs 2 \
      --warmup-prompts 1
    all3; BENCH_LIMIT=150 TAIL=4 bench 8b_fp8_new --shape qwen3-8b --attention triton --kv-cache-dtype fp8 --runs 2 \
      --warmup-prompts 1
    TAIL=4 bench bf16_new --attention triton --runs 2 --warmup-prompts 1
    BENCH_LIMIT=150 TAIL=4 bench 8b_bf16_new --shape qwen3-8b --attention triton --runs 2 --warmup-prompts 1
    pack
    ;;
  r13-b)  # round 13, one H200 (about 9 minutes): the Triton SiLU-and-mul kernel: its GPU tests and the engine's
    # transformers parity, the small kernels timed (SiLU both ways, the split merge per num_warps), then the 0.6B
    # and 8B offline on the FP8 cache with the kernel and without it (torch.compile's fusion), back to back
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=6 step gpu_tests 150 python -m pytest tests/unit/test_silu_and_mul_kernel.py tests/gpu/test_gpu_engine.py \
      -m gpu -q -rf -k "silu or greedy_and_logits"
    TAIL=20 step small_kernels 60 python benchmarks/small_kernels.py
    cp nanovllm_core/layers/activation.py /tmp/activation_with.py
    without() { sed -i 's/if x.is_cuda and fused_enabled() and/if False and/' nanovllm_core/layers/activation.py; }
    TAIL=4 bench fp8_silu --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    without; TAIL=4 bench fp8_compiled --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    BENCH_LIMIT=150 TAIL=4 bench 8b_fp8_compiled --shape qwen3-8b --attention triton --kv-cache-dtype fp8 --runs 2 \
      --warmup-prompts 1
    cp /tmp/activation_with.py nanovllm_core/layers/activation.py
    BENCH_LIMIT=150 TAIL=4 bench 8b_fp8_silu --shape qwen3-8b --attention triton --kv-cache-dtype fp8 --runs 2 \
      --warmup-prompts 1
    pack
    ;;
  r13-a)  # round 13, one H200 (about 8 minutes): where the steps that run prompts spend their time (--profile now
    # profiles them too), on the 0.6B and the 8B (FP8 cache), the 8B decode step at 64, 128 and 256 sequences; then
    # the priority server (two classes, nano-vllm workload) idle and at round 8's 70% load, async scheduling on, off
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=60 bench fp8_profile --attention triton --kv-cache-dtype fp8 --runs 1 --warmup-prompts 1 --profile \
      --profile-seqs 64,256
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    BENCH_LIMIT=200 TAIL=80 bench 8b_fp8_profile --shape qwen3-8b --attention triton --kv-cache-dtype fp8 --runs 1 \
      --warmup-prompts 1 --profile --profile-seqs 64,128,256
    for mode in on off; do
      serve_start "priority_async_$mode" --scheduler priority --max-num-batched-tokens 2048 --async-scheduling "$mode"
      TAIL=3 serve_bench "priority_${mode}_idle" --dataset nano --num-prompts 24 --request-rate 2 --priorities 0,1
      stages "priority_${mode}_idle"
      TAIL=3 serve_bench "priority_${mode}_70" --dataset nano --num-prompts 512 --request-rate 33.6 \
        --priorities 0,1 --warmup 0
      stages "priority_${mode}_70" "priority_${mode}_idle"
      serve_stop
    done
    summarize "$OUT"/serve_*.json
    pack
    ;;
  r12-d)  # round 12, one H200 (about 2 minutes): min_tokens, logit_bias and allowed_token_ids on CUDA (the tiny
    # checkpoint, greedy and seeded sampling), then the 0.6B offline on the bf16 cache once (host preparation with
    # the new per-row checks)
    TAIL=3 step logit_adjustments 60 python benchmarks/gpu_logit_adjustments_check.py
    TAIL=4 bench bf16 --attention triton --runs 1 --warmup-prompts 1
    pack
    ;;
  r12-c)  # round 12, one H200 (about 9 minutes): decode_fusion on and off, back to back: the 0.6B on both caches
    # while the 8B checkpoint is written, then the 8B on both caches (runs at b5f3965, where decode_fusion exists)
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    printf '[plugins]\nattention = "triton"\nattention_options = { decode_fusion = false }\n' > /tmp/unfused.toml
    for cache in fp8 auto; do
      TAIL=2 bench "${cache}" --attention triton --kv-cache-dtype $cache --runs 2 --warmup-prompts 1
      TAIL=2 bench "${cache}_unfused" --config /tmp/unfused.toml --kv-cache-dtype $cache --runs 2 --warmup-prompts 1
    done
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    for cache in fp8 auto; do
      BENCH_LIMIT=110 TAIL=2 bench "8b_${cache}" --shape qwen3-8b --attention triton --kv-cache-dtype $cache --runs 2 \
        --warmup-prompts 1
      BENCH_LIMIT=110 TAIL=2 bench "8b_${cache}_unfused" --shape qwen3-8b --config /tmp/unfused.toml \
        --kv-cache-dtype $cache --runs 2 --warmup-prompts 1
    done
    pack
    ;;
  r12-b)  # round 12, one H200 (about 9 minutes): e4m3 to float16 by integer operations (NANOVLLM_E4M3_PATH: keys
    # and values by bits, values only ("mixed", the default), or Hopper's conversion for both); the FP8 GPU tests
    # with both by bits, the FP8 kernels and the 0.6B offline on each path, the 8B on two (its checkpoint written
    # meanwhile). It ran b5f3965 with a variant that was measured and never committed: docs/benchmarks.md, round 12
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=4 NANOVLLM_E4M3_PATH=bits step fp8_gpu_tests_bits 170 python -m pytest plugins/attention_flash/tests -m gpu \
      -q -k "fp8 or stores_like" -rf
    for path in cvt bits mixed; do
      TAIL=3 NANOVLLM_E4M3_PATH=$path step "kernels_$path" 60 python plugins/attention_flash/bench_kernels.py \
        --backends triton_fp8 --out "$OUT/kernels_$path.md"
      grep -E "B=256 ctx=(1024|4096)|16 prompts" "$OUT/kernels_$path.md"
    done
    for path in cvt bits mixed; do
      TAIL=4 NANOVLLM_E4M3_PATH=$path bench "fp8_$path" --attention triton --kv-cache-dtype fp8 --runs 2 \
        --warmup-prompts 1
    done
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    for path in mixed bits; do
      BENCH_LIMIT=120 TAIL=4 NANOVLLM_E4M3_PATH=$path bench "8b_fp8_$path" --shape qwen3-8b --attention triton \
        --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    done
    pack
    ;;
  r12-a)  # round 12, one H200 (about 9 minutes): the decode kernel stores the step's keys/values and merges its
    # splits itself (decode_fusion); every attention GPU test, then the 0.6B offline with and without it on both
    # caches, back to back, and the 8B on the FP8 cache with it (its checkpoint written meanwhile; runs at b5f3965)
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=6 step attention_gpu_tests 200 python -m pytest plugins/attention_flash/tests -m gpu -q -rf
    printf '[plugins]\nattention = "triton"\nattention_options = { decode_fusion = false }\n' > /tmp/unfused.toml
    TAIL=4 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    TAIL=4 bench fp8_unfused --config /tmp/unfused.toml --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    TAIL=4 bench bf16 --attention triton --runs 2 --warmup-prompts 1
    TAIL=4 bench bf16_unfused --config /tmp/unfused.toml --runs 2 --warmup-prompts 1
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    BENCH_LIMIT=150 TAIL=4 bench 8b_fp8 --shape qwen3-8b --attention triton --kv-cache-dtype fp8 --runs 2 \
      --warmup-prompts 1
    pack
    ;;
  r11-e)  # round 11, one H200 (about 3 minutes): the FP8 decode tile's pipeline depth (one-warp programs with 2, 3 or 4
    # stages, two-warp ones) on the 0.6B's heads; then the 0.6B FP8 offline with the default tile and with 2 stages
    TAIL=3 step decode_sweep_fp8 80 python plugins/attention_flash/bench_kernels.py --sweep decode \
      --kv-cache-dtype fp8 --out "$OUT/decode_sweep_fp8.md"
    printf '[plugins]\nattention = "triton"\nattention_options = { decode_num_stages = 2 }\n' > /tmp/stages2.toml
    TAIL=4 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    TAIL=4 bench fp8_stages2 --config /tmp/stages2.toml --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    pack
    ;;
  r11-d)  # round 11, one H200 (about 8 minutes): the one-warp FP8 decode tile for four query heads a KV head too;
    # every FP8 GPU test while the 8B checkpoint is written, the 8B offline on both caches, the 8B's FP8 accuracy
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=4 step fp8_gpu_tests 200 python -m pytest plugins/attention_flash/tests -m gpu -q -k fp8 -rf
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    BENCH_LIMIT=150 TAIL=4 bench 8b_bf16 --shape qwen3-8b --attention triton --runs 2 --warmup-prompts 1
    BENCH_LIMIT=150 TAIL=4 bench 8b_fp8 --shape qwen3-8b --attention triton --kv-cache-dtype fp8 --runs 2 \
      --warmup-prompts 1
    TAIL=12 step fp8_accuracy_8b 150 python benchmarks/fp8_accuracy.py --shape qwen3-8b \
      --json "$OUT/fp8_accuracy_8b.json"
    pack
    ;;
  r11-c)  # round 11, one H200 (about 9 minutes): float16 dots in the FP8 prefill kernel too; every FP8 GPU test, the
    # kernels on both caches (bf16, FP8), the 0.6B and 8B offline on both caches, FP8 accuracy, the FP8 decode tiles
    # for the 8B's four query heads a KV head; the 8B checkpoint is written meanwhile
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=4 step fp8_gpu_tests 200 python -m pytest plugins/attention_flash/tests -m gpu -q -k fp8 -rf
    TAIL=14 step kernels 90 python plugins/attention_flash/bench_kernels.py --backends triton,triton_fp8 \
      --out "$OUT/kernels.md"
    TAIL=4 bench bf16 --attention triton --runs 2 --warmup-prompts 1
    TAIL=4 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    TAIL=12 step fp8_accuracy 100 python benchmarks/fp8_accuracy.py --shape qwen3-0.6b --json "$OUT/fp8_accuracy.json"
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    BENCH_LIMIT=150 TAIL=4 bench 8b_bf16 --shape qwen3-8b --attention triton --runs 2 --warmup-prompts 1
    BENCH_LIMIT=150 TAIL=4 bench 8b_fp8 --shape qwen3-8b --attention triton --kv-cache-dtype fp8 --runs 2 \
      --warmup-prompts 1
    TAIL=8 step decode_sweep_fp8_32q 60 python plugins/attention_flash/bench_kernels.py --sweep decode \
      --kv-cache-dtype fp8 --num-heads 32 --out "$OUT/decode_sweep_fp8_32q.md"
    pack
    ;;
  r11-b)  # round 11, one H200 (about 8 minutes): the FP8 decode kernel's dots in float16 (one conversion a value
    # pair, none to bfloat16): every FP8 GPU test, the 0.6B offline bf16 then FP8, FP8 accuracy, the FP8 tile sweep
    TAIL=6 step fp8_gpu_tests 240 python -m pytest plugins/attention_flash/tests -m gpu -q -k fp8 -rf
    TAIL=5 bench bf16 --attention triton --runs 2 --warmup-prompts 1
    TAIL=5 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    TAIL=30 step fp8_accuracy 150 python benchmarks/fp8_accuracy.py --shape qwen3-0.6b --json "$OUT/fp8_accuracy.json"
    TAIL=16 step decode_sweep_fp8 120 python plugins/attention_flash/bench_kernels.py --sweep decode \
      --kv-cache-dtype fp8 --out "$OUT/decode_sweep_fp8.md"
    pack
    ;;
  r11-a)  # round 11, one H200 (about 5 minutes): does an L2 prefetch of the next GEMM's weights shorten the 0.6B's
    # decode chain (benchmarks/l2_prefetch.py: 28 layers of cuBLAS GEMMs and small kernels in one CUDA graph), two
    # prefetch sizes; then the 0.6B offline without and with TORCHINDUCTOR_ENABLE_PDL=1 (inductor's kernels launched
    # with programmatic dependent launch), back to back
    TAIL=50 step l2_prefetch 150 python benchmarks/l2_prefetch.py
    TAIL=26 step l2_prefetch_64k 100 python benchmarks/l2_prefetch.py --chunk 65536 --block 32 --rounds 1
    TAIL=5 bench bf16 --attention triton --runs 2 --warmup-prompts 1
    TAIL=5 TORCHINDUCTOR_ENABLE_PDL=1 bench bf16_pdl --attention triton --runs 2 --warmup-prompts 1
    pack
    ;;
  r10-d)  # round 10, one H200 (about 8 minutes): the FP8 cache's own decode tile (32 keys, one warp, splits for 16 warps
    # an SM) as the default: every FP8 GPU test, the 0.6B offline bf16 and FP8, FP8 accuracy, and the FP8 decode tiles
    # for four query heads a KV head (the 8B's group, which keeps the four-warp tile)
    TAIL=8 step fp8_gpu_tests 240 python -m pytest plugins/attention_flash/tests -m gpu -q -k fp8 -rf
    TAIL=5 bench bf16 --attention triton --runs 2 --warmup-prompts 1
    TAIL=5 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    TAIL=30 step fp8_accuracy 150 python benchmarks/fp8_accuracy.py --shape qwen3-0.6b --json "$OUT/fp8_accuracy.json"
    TAIL=10 step decode_sweep_fp8_32q 120 python plugins/attention_flash/bench_kernels.py --sweep decode \
      --kv-cache-dtype fp8 --num-heads 32 --out "$OUT/decode_sweep_fp8_32q.md"
    pack
    ;;
  r10-c)  # round 10, one H200 (about 7 minutes): the FP8 decode tiles on uniform and ragged contexts, each split count;
    # then the 0.6B offline: bf16, FP8 with the default tile, FP8 with 32-key one-warp tiles and 2 or 4 KV splits at
    # every batch size (r10-b ran that tile with the default split count, which is 1 at 256 sequences)
    TAIL=60 step decode_sweep_fp8 250 python plugins/attention_flash/bench_kernels.py --sweep decode \
      --kv-cache-dtype fp8 --out "$OUT/decode_sweep_fp8.md"
    TAIL=5 bench bf16 --attention triton --runs 2 --warmup-prompts 1
    TAIL=5 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    for splits in 2 4; do
      printf '[plugins]\nattention_options = { decode_block_n = 32, decode_num_warps = 1, decode_num_stages = 3, %s }\n' \
        "num_kv_splits = $splits" > "$OUT/fp8_w1_s$splits.toml"
      TAIL=5 bench "fp8_w1_s$splits" --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1 \
        --config "$OUT/fp8_w1_s$splits.toml"
    done
    pack
    ;;
  r10-b)  # round 10, one H200 (about 6 minutes): the FP8 decode kernel's tile sweep with fewer warps and stages (its
    # occupancy was 3 programs an SM, r10-a's Nsight Compute), then the 0.6B offline on FP8 with the sweep's fastest
    # tile at 256 x 1,024 against the default tile
    TAIL=60 step decode_sweep_fp8 200 python plugins/attention_flash/bench_kernels.py --sweep decode \
      --kv-cache-dtype fp8 --out "$OUT/decode_sweep_fp8.md"
    python - "$OUT/decode_sweep_fp8.md" > /tmp/fp8_tile.toml <<'PY'
import re, sys
best = None
for line in open(sys.argv[1]):
    m = re.match(r"\| sweep-d \| B=256 ctx=1024 n(\d+) w(\d+) s(\d+) splits=auto \| triton_fp8 \| ([\d.]+)", line)
    if m and (best is None or float(m[4]) < best[3]):
        best = (int(m[1]), int(m[2]), int(m[3]), float(m[4]))
n, w, st, us = best
print(f"# fastest at 256 x 1,024: {us} us\n[plugins]\nattention_options = {{ decode_block_n = {n}, "
      f"decode_num_warps = {w}, decode_num_stages = {st} }}")
PY
    cat /tmp/fp8_tile.toml | tee "$OUT/fp8_tile.toml"
    TAIL=5 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    TAIL=5 bench fp8_tile --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1 --config /tmp/fp8_tile.toml
    pack
    ;;
  r9-f)  # round 9, one H200 (about 2 minutes): the 0.6B decode step profiled at 16, 64 and 256 sequences: kernel
    # time against the steps' span, kernel by kernel
    TAIL=70 bench profile --attention triton --runs 1 --warmup-prompts 1 --profile --profile-seqs 16,64,256
    pack
    ;;
  r9-e)  # round 9, one H200 (about 4 minutes): fifo and priority over saturation, two priority classes, nano-vllm
    # workload: all 512 at once, then at 72 req/s (1.5x round 8's fifo saturation, 48.0 req/s)
    for policy in fifo priority; do
      if [ "$policy" = fifo ]; then serve_start fifo; else serve_start priority --scheduler priority \
        --max-num-batched-tokens 2048; fi
      TAIL=3 serve_bench "${policy}_nano_inf" --dataset nano --num-prompts 512 --request-rate inf --priorities 0,1
      TAIL=3 serve_bench "${policy}_nano_150" --dataset nano --num-prompts 512 --request-rate 72 --priorities 0,1 \
        --warmup 0
      stages "${policy}_nano_150" "${policy}_nano_inf"
      serve_stop
    done
    summarize "$OUT"/serve_*.json
    pack
    ;;
  r9-d)  # round 9, one H200 (about 7 minutes): the decode-step fit on both shapes (0.6B with --profile: its kernels
    # per step), the 8B checkpoint written meanwhile
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=26 bench bf16 --attention triton --runs 2 --warmup-prompts 1 --profile
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    BENCH_LIMIT=240 TAIL=6 bench 8b_bf16 --shape qwen3-8b --attention triton --runs 2 --warmup-prompts 1
    pack
    ;;
  r8-fp8)  # round 8, one H200 (about 7 minutes): FP8 kernels. The decode kernel's float16-dot variant (commit
    # 191f90c, reverted after this phase measured it slower), then the prefill kernel's (e9d3833): every fp8 GPU
    # test, the kernels against bf16, bf16 and fp8 offline, fp8 accuracy, the fp8 decode tile sweep
    TAIL=6 step fp8_tests 170 python -m pytest plugins/attention_flash/tests -m gpu -q -k fp8 -rf
    TAIL=60 step kernels 150 python plugins/attention_flash/bench_kernels.py --backends triton,triton_fp8 \
      --out "$OUT/kernels_fp8.md"
    TAIL=5 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    TAIL=5 bench bf16 --attention triton --runs 2 --warmup-prompts 1
    TAIL=30 step fp8_accuracy 150 python benchmarks/fp8_accuracy.py --shape qwen3-0.6b --json "$OUT/fp8_accuracy.json"
    TAIL=30 step decode_sweep_fp8 120 python plugins/attention_flash/bench_kernels.py --sweep decode \
      --kv-cache-dtype fp8 --out "$OUT/decode_sweep_fp8.md"
    pack
    ;;
  r8-perf)  # round 8, one H200 (about 8 minutes): bf16 and fp8 KV caches on the 0.6B and 8B shapes (offline, the
    # per-step bound beside the additive one), the fp8 accuracy benchmark; the 8B checkpoint is written meanwhile
    setsid nice -n 10 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    TAIL=5 bench bf16 --attention triton --runs 2 --warmup-prompts 1
    TAIL=5 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
    TAIL=30 step fp8_accuracy 150 python benchmarks/fp8_accuracy.py --shape qwen3-0.6b --json "$OUT/fp8_accuracy.json"
    for _ in $(seq 1 240); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done
    tail -2 /tmp/ckpt_8b.log
    BENCH_LIMIT=200 TAIL=5 bench 8b_bf16 --shape qwen3-8b --attention triton --runs 2 --warmup-prompts 1
    BENCH_LIMIT=200 TAIL=5 bench 8b_fp8 --shape qwen3-8b --attention triton --kv-cache-dtype fp8 --runs 2 \
      --warmup-prompts 1
    pack
    ;;
  r8-sched)  # round 8, one H200 (about 6 minutes): the policies on an engine-bound load. Long prompts (vLLM's random
    # dataset, 2,250-3,750 prompt tokens, 192-320 output tokens) at 70% of fifo's all-at-once rate through fifo and
    # mixed; priority (two classes) idle and at 70% load on the nano-vllm workload and on the long prompts; then
    # sharegpt-synth at 70% through priority again. Each run's request stages from /metrics (one warm-up a server)
    long=(--dataset random --random-input-len 3000 --random-output-len 256 --random-range-ratio 0.25)
    serve_start fifo
    TAIL=3 serve_bench fifo_long_sat "${long[@]}" --num-prompts 400 --request-rate inf
    TAIL=3 serve_bench fifo_nano_sat --dataset nano --num-prompts 512 --request-rate inf --warmup 0
    TAIL=3 serve_bench fifo_synth_sat --dataset sharegpt-synth --num-prompts 1000 --request-rate inf --warmup 0
    LONG_RATE=$(rate_of "$OUT/serve_fifo_long_sat.json" 0.7); NANO_RATE=$(rate_of "$OUT/serve_fifo_nano_sat.json" 0.7)
    SYNTH_RATE=$(rate_of "$OUT/serve_fifo_synth_sat.json" 0.7)
    echo "== 70% rates: long $LONG_RATE, nano $NANO_RATE, sharegpt-synth $SYNTH_RATE req/s" | tee "$OUT/rates.txt"
    TAIL=2 serve_bench fifo_long_70 "${long[@]}" --num-prompts 600 --request-rate "$LONG_RATE" --warmup 0
    stages fifo_long_70 fifo_synth_sat
    TAIL=2 serve_bench fifo_nano_70 --dataset nano --num-prompts 512 --request-rate "$NANO_RATE" --warmup 0
    stages fifo_nano_70 fifo_long_70
    serve_stop
    serve_start mixed --scheduler mixed --max-num-batched-tokens 2048
    TAIL=2 serve_bench mixed_long_70 "${long[@]}" --num-prompts 600 --request-rate "$LONG_RATE"
    stages mixed_long_70
    TAIL=2 serve_bench mixed_nano_70 --dataset nano --num-prompts 512 --request-rate "$NANO_RATE" --warmup 0
    stages mixed_nano_70 mixed_long_70
    serve_stop
    serve_start priority --scheduler priority --max-num-batched-tokens 2048
    TAIL=3 serve_bench priority_nano_idle --dataset nano --num-prompts 24 --request-rate 2 --priorities 0,1
    TAIL=3 serve_bench priority_nano_70 --dataset nano --num-prompts 512 --request-rate "$NANO_RATE" --priorities 0,1 \
      --warmup 0
    stages priority_nano_70 priority_nano_idle
    TAIL=3 serve_bench priority_long_idle "${long[@]}" --num-prompts 24 --request-rate 2 --priorities 0,1 --warmup 0
    TAIL=3 serve_bench priority_long_70 "${long[@]}" --num-prompts 600 --request-rate "$LONG_RATE" --priorities 0,1 \
      --warmup 0
    stages priority_long_70 priority_long_idle
    TAIL=3 serve_bench priority_synth_70 --dataset sharegpt-synth --num-prompts 1000 --request-rate "$SYNTH_RATE" \
      --priorities 0,1 --warmup 0
    stages priority_synth_70 priority_long_70
    serve_stop
    summarize "$OUT"/serve_*.json
    pack
    ;;
  r7-b)  # round 7, one H200 (about 8 minutes): the mixed-step CUDA graphs: their GPU tests, mixed offline
    # (2,048-token steps), then fifo and mixed (2,048-token steps) against rate at $RATES (30/50/70/90% of r7-a's
    # saturation), 1,000 sharegpt-synth requests per rate
    TAIL=12 step graph_tests 200 python -m pytest tests/gpu/test_gpu_engine.py \
      plugins/attention_flash/tests/test_conformance_attention.py -m gpu -q -s -rf -k "replay_graphs or Triton or triton"
    TAIL=6 bench mixed_2048 --attention triton --scheduler mixed --max-num-batched-tokens 2048 --runs 2 --warmup-prompts 1
    rate_lanes "${RATES:?30/50/70/90% of saturation}" fifo "mixed --scheduler mixed --max-num-batched-tokens 2048"
    pack
    ;;
  r7-d)  # round 7, one H200 (about 5 minutes): the GPU tests the mixed-step graphs touch (engine parity, logprobs,
    # sampling, the model plugin's kernels, the fp8 engine), then what the first generate compiles or allocates
    TAIL=10 step gpu_tests 210 python -m pytest tests/gpu tests/engine/test_logprobs.py tests/unit/test_sampling_kernel.py \
      plugins/models_qwen3/tests plugins/attention_flash/tests/test_gpu_fp8_engine.py -m gpu -q -rf -k "not tp2"
    TAIL=30 step cold_paths 120 env TORCH_LOGS=recompiles python benchmarks/cold_paths.py --json "$OUT/cold_paths.json"
    pack
    ;;
  r7-c)  # round 7, one H200 (about 7 minutes): the decode GEMMs (graph-timed); fifo, mixed and priority offline back
    # to back; priority (two classes, 2,048-token steps) after an idle run at $RATES; then the nano-vllm workload's
    # long prompts arriving at $NANO_RATE req/s (70% of its all-at-once rate) through fifo and mixed
    for shape in qwen3-0.6b qwen3-8b; do
      TAIL=3 step "gemm_$shape" 90 python benchmarks/decode_gemm.py --shape "$shape" --json "$OUT/gemm_$shape.json"
    done
    TAIL=4 bench fifo --attention triton --runs 2 --warmup-prompts 1
    TAIL=4 bench mixed_2048 --attention triton --scheduler mixed --max-num-batched-tokens 2048 --runs 2 --warmup-prompts 1
    TAIL=4 bench priority_2048 --attention triton --scheduler priority --max-num-batched-tokens 2048 --runs 2 \
      --warmup-prompts 1
    serve_start priority --scheduler priority --max-num-batched-tokens 2048
    TAIL=2 serve_bench priority_idle --dataset sharegpt-synth --num-prompts 20 --request-rate 2 --priorities 0,1
    BENCH_LIMIT=150 TAIL=2 serve_bench priority_rates --dataset sharegpt-synth --num-prompts 1000 --rates "$RATES" \
      --priorities 0,1
    serve_stop
    summarize "$OUT"/serve_priority_idle.json "$OUT"/serve_priority_rates.json
    for lane in "fifo" "mixed --scheduler mixed --max-num-batched-tokens 2048"; do
      set -- $lane; name=$1; shift
      serve_start "$name" "$@" || continue
      TAIL=2 serve_bench "${name}_nano_rate" --dataset nano --request-rate "${NANO_RATE:?req/s}"
      serve_stop
      summarize "$OUT/serve_${name}_nano_rate.json"
    done
    pack
    ;;
  r7-a)  # round 7, one H200 (about 6 minutes): every fp8 GPU test (the byte-building store kernel), the offline
    # bench alone (first run against steady), the decode GEMMs with L2-cold weights, the server all at once
    TAIL=8 step fp8_tests 170 python -m pytest plugins/attention_flash/tests -m gpu -q -k fp8 -rf
    TAIL=8 bench fifo --attention triton --runs 3 --warmup-prompts 1
    TAIL=40 step gemm_qwen3-0.6b 90 python benchmarks/decode_gemm.py --shape qwen3-0.6b --json "$OUT/gemm_qwen3-0.6b.json"
    serve_start fifo
    TAIL=14 serve_bench fifo_nano --dataset nano --request-rate inf
    TAIL=4 serve_bench fifo_sat --dataset sharegpt-synth --num-prompts 1000 --request-rate inf
    serve_stop
    pack
    ;;
  r6)  # round 6, two H200s (about 6 minutes): the offline bench alone (a clean first-run gap), then two lanes: GPU 0
    # the server all at once and fifo against rate, GPU 1 every fp8 GPU test, then mixed and priority at fifo's rates
    (export CUDA_VISIBLE_DEVICES=0; TAIL=8 bench fifo --attention triton --runs 3 --warmup-prompts 1)
    (
      export CUDA_VISIBLE_DEVICES=0 PORT=8000
      fifo_serve_lane 1000 300
    ) > "$OUT/lane0.txt" 2>&1 &
    (
      export CUDA_VISIBLE_DEVICES=1 PORT=8001
      for shape in qwen3-0.6b qwen3-8b; do
        TAIL=70 step "gemm_$shape" 90 python benchmarks/decode_gemm.py --shape "$shape" --json "$OUT/gemm_$shape.json"
      done
      TAIL=6 step fp8_tests 150 python -m pytest plugins/attention_flash/tests -m gpu -q -k fp8 -rf
      policy_lane 1000 300
    ) > "$OUT/lane1.txt" 2>&1 &
    join_lanes
    ;;
  r6-tp)  # round 6, two H200s: every TP/DP GPU test with room to finish (stacks on a hang), then DP=2 offline
    TAIL=40 step tp_tests 420 env PYTHONFAULTHANDLER=1 timeout -s ABRT 400 python -m pytest tests/engine/test_tp_async.py \
      tests/engine/test_tp_allreduce.py tests/engine/test_tp_lifecycle.py tests/engine/test_data_parallel.py \
      tests/gpu/test_gpu_engine.py::test_tp2_over_nccl_matches_tp1 -m gpu -q -s -rf --durations 12
    TAIL=4 bench dp2 --attention triton --data-parallel-size 2 --runs 2 --warmup-prompts 1
    pack
    ;;
  r5)  # round 5, two H200s, one call: the TP/DP GPU tests after the graph release (both GPUs), then the server
    # (GPU 0: offline bench, all at once, fifo against rate; GPU 1: mixed and priority) and the FP8 store tests
    TAIL=30 step tp_tests 170 env PYTHONFAULTHANDLER=1 timeout -s ABRT 165 python -m pytest tests/engine/test_tp_async.py \
      tests/engine/test_tp_lifecycle.py tests/engine/test_data_parallel.py -m gpu -q -s -rf --durations 8
    (
      export CUDA_VISIBLE_DEVICES=0 PORT=8000
      TAIL=8 bench fifo --attention triton --runs 2 --warmup-prompts 1
      fifo_serve_lane 1000 300
      TAIL=4 step fp8_store_tests 120 python -m pytest plugins/attention_flash/tests/test_gpu_backends.py -m gpu -q \
        -k "fp8_store" -rf
    ) > "$OUT/lane0.txt" 2>&1 &
    (
      export CUDA_VISIBLE_DEVICES=1 PORT=8001
      policy_lane 1000 300
    ) > "$OUT/lane1.txt" 2>&1 &
    join_lanes
    ;;
  r4-serve)  # next round, two H200s: the server after the intake and uvloop changes, 1,500 requests per rate
    # (about 9 minutes: both lanes fit one call)
    (
      export CUDA_VISIBLE_DEVICES=0 PORT=8000
      TAIL=8 bench fifo --attention triton --runs 3 --warmup-prompts 1
      fifo_serve_lane 1500 400
    ) > "$OUT/lane0.txt" 2>&1 &
    (
      export CUDA_VISIBLE_DEVICES=1 PORT=8001
      policy_lane 1500 400
    ) > "$OUT/lane1.txt" 2>&1 &
    join_lanes
    ;;
  r4-tp)  # next round, two H200s: the TP/DP GPU tests with the bounded shutdown, then the 8B NCCL exit
    step tp_parity 120 python -m pytest tests/gpu/test_gpu_engine.py -m gpu -q -s -k tp2 --durations 3
    step tp_tests 300 python -m pytest tests/engine/test_tp_async.py tests/engine/test_tp_allreduce.py \
      tests/engine/test_tp_lifecycle.py tests/engine/test_data_parallel.py -m gpu -q -s --durations 5
    TAIL=6 step fp8_tests 200 python -m pytest plugins/attention_flash/tests -m gpu -q -k fp8
    pack
    ;;
  r3-single)  # round 3 on a two-H200 machine, one GPU per lane, both lanes at once:
    # GPU 0: offline bench, the server all at once, fifo's saturation and its latency against rate;
    # GPU 1: FP8 kernel tests and accuracy, the FP8 bench, then mixed and priority at fifo's rates.
    # Meanwhile the CPU writes the random Qwen3-8B checkpoint for the r3-8b phase.
    # (its own session, so that it outlives this call; on 8 cores of 32, away from the lanes' host work)
    setsid nice -n 19 taskset -c 24-31 env OMP_NUM_THREADS=8 python -c \
      "import torch; from nanovllm_core.benchmark import random_checkpoint as r; print(r('qwen3-8b', torch.bfloat16))" \
      > /tmp/ckpt_8b.log 2>&1 < /dev/null &
    (
      export CUDA_VISIBLE_DEVICES=0 PORT=8000
      TAIL=8 bench fifo --attention triton --runs 3 --warmup-prompts 1
      serve_start fifo
      TAIL=14 serve_bench fifo_nano --dataset nano --request-rate inf
      TAIL=3 serve_bench fifo_sat --dataset sharegpt-synth --num-prompts 400 --request-rate inf
      sat=$(python -c "import json; d = json.load(open('$OUT/serve_fifo_sat.json')); print(d['request_throughput'])")
      python -c "print(','.join(f'{f * $sat:.1f}' for f in (0.3, 0.5, 0.7, 0.9)))" > "$OUT/rates.txt"
      echo "== saturation $sat req/s; rates $(cat "$OUT/rates.txt")"
      TAIL=3 serve_bench fifo_rates --dataset sharegpt-synth --num-prompts 400 --rates "$(cat "$OUT/rates.txt")"
      serve_stop
    ) > "$OUT/lane0.txt" 2>&1 &
    (
      export CUDA_VISIBLE_DEVICES=1 PORT=8001
      TAIL=6 step fp8_tests 150 python -m pytest plugins/attention_flash/tests -m gpu -q -x -k fp8
      TAIL=30 step fp8_accuracy 150 python benchmarks/fp8_accuracy.py --shape qwen3-0.6b --json "$OUT/fp8_accuracy.json"
      TAIL=4 bench fp8 --attention triton --kv-cache-dtype fp8 --runs 2 --warmup-prompts 1
      for _ in $(seq 1 200); do [ -s "$OUT/rates.txt" ] && break; sleep 1; done
      for policy in mixed priority; do
        serve_start "$policy" --scheduler "$policy"
        extra=(); [ "$policy" = priority ] && extra=(--priorities 0,1)
        [ "$policy" = priority ] && TAIL=3 serve_bench priority_idle --dataset sharegpt-synth --num-prompts 20 \
          --request-rate 2 --priorities 0,1
        TAIL=3 serve_bench "${policy}_rates" --dataset sharegpt-synth --num-prompts 400 --rates "$(cat "$OUT/rates.txt")" "${extra[@]}"
        serve_stop
      done
    ) > "$OUT/lane1.txt" 2>&1 &
    join_lanes
    ;;
  r3-tp)  # two GPUs: TP and DP tests, all-reduce micro-benchmark, the 0.6B workload at TP=2 and DP=2
    step tp_parity 120 python -m pytest tests/gpu/test_gpu_engine.py -m gpu -q -s -k tp2 --durations 3
    step tp_tests 240 python -m pytest tests/engine/test_tp_async.py tests/engine/test_tp_allreduce.py \
      tests/engine/test_tp_lifecycle.py tests/engine/test_data_parallel.py -m gpu -q -s --durations 5
    TAIL=40 step allreduce 150 python benchmarks/allreduce.py --json "$OUT/allreduce.json"
    python -c "import json; s = json.load(open('$OUT/allreduce.json'))['suggested']; print(f'export \
NANOVLLM_ALLREDUCE_ONE_SHOT_MAX_BYTES={s[\"one_shot\"]} NANOVLLM_ALLREDUCE_TWO_SHOT_MAX_BYTES={s[\"two_shot\"]}')" \
      > /tmp/symm.env && cat /tmp/symm.env
    (source /tmp/symm.env && TAIL=4 bench tp2_symm --attention triton --tensor-parallel-size 2 --runs 2 --warmup-prompts 1)
    TAIL=4 bench tp2 --attention triton --tensor-parallel-size 2 --runs 2 --warmup-prompts 1
    TAIL=4 bench dp2 --attention triton --data-parallel-size 2 --runs 2 --warmup-prompts 1
    tail -3 /tmp/ckpt_8b.log; ls -la /tmp/nanovllm-bench-qwen3-8b-bfloat16 | head
    pack
    ;;
  r3-8b)  # two GPUs: the 8B shape at TP=1 and TP=2 (checkpoint written during r3-single)
    for _ in $(seq 1 300); do grep -q nanovllm-bench /tmp/ckpt_8b.log && break; sleep 1; done  # written to the end
    tail -2 /tmp/ckpt_8b.log
    BENCH_LIMIT=240 TAIL=4 bench 8b_tp1 --shape qwen3-8b --attention triton --runs 2 --warmup-prompts 1
    BENCH_LIMIT=240 TAIL=4 bench 8b_tp2 --shape qwen3-8b --attention triton --tensor-parallel-size 2 --runs 2 --warmup-prompts 1
    [ -s /tmp/symm.env ] && (source /tmp/symm.env && BENCH_LIMIT=240 TAIL=4 bench 8b_tp2_symm --shape qwen3-8b \
      --attention triton --tensor-parallel-size 2 --runs 2 --warmup-prompts 1)
    pack
    ;;
  r2-a)  # round 2: plugin API 2 on the GPU: GPU tests, first and steady runs, fp8 KV cache, then the previous engine
    step gpu_tests 230 python -m pytest tests/gpu/test_gpu_engine.py tests/engine/test_logprobs.py tests/unit/test_sampling_kernel.py \
      plugins/models_qwen3/tests/test_qk_norm_rope.py -m gpu -q -x -s -k "not flash_attn and not tp2"
    step kernel_tests 200 python -m pytest plugins/attention_flash/tests -m gpu -q -x -s -k "not flash_attn"
    TAIL=8 bench triton --attention triton --runs 3 --warmup-prompts 1
    TAIL=4 bench triton_fp8 --attention triton --kv-cache-dtype fp8
    if [ -d .bench-old ]; then  # the engine before this round, same machine, back to back
      python -m pip install -q --no-deps --no-build-isolation --no-index -e .bench-old -e .bench-old/plugins/scheduler_fifo \
        -e .bench-old/plugins/attention_flash -e .bench-old/plugins/models_qwen3 >> "$OUT/pip.log" 2>&1
      (cd .bench-old && TAIL=4 bench old_triton --attention triton)
    fi
    pack
    ;;
  r2-serve)  # the server: all at once (against r2-a's offline run), then latency against rate for each policy
    TAIL=8 step kernel_tests 170 python -m pytest plugins/attention_flash/tests -m gpu -q -k "not flash_attn"
    serve_start fifo
    TAIL=14 serve_bench fifo_nano --dataset nano --request-rate inf
    TAIL=14 serve_bench fifo_sat --dataset sharegpt-synth --num-prompts 400 --request-rate inf
    sat=$(python -c "import json; d = json.load(open('$OUT/serve_fifo_sat.json')); print(d['request_throughput'])")
    rates=$(python -c "print(','.join(f'{f * $sat:.1f}' for f in (0.3, 0.5, 0.7, 0.9)))")
    echo "== saturation $sat req/s; rates $rates"
    TAIL=40 serve_bench fifo_rates --dataset sharegpt-synth --num-prompts 400 --rates "$rates"
    serve_stop
    for policy in mixed priority; do
      serve_start "$policy" --scheduler "$policy"
      extra=(); [ "$policy" = priority ] && extra=(--priorities 0,1)
      [ "$policy" = priority ] && TAIL=14 serve_bench priority_idle --dataset sharegpt-synth --num-prompts 20 \
        --request-rate 2 --priorities 0,1
      TAIL=40 serve_bench "${policy}_rates" --dataset sharegpt-synth --num-prompts 400 --rates "$rates" "${extra[@]}"
      serve_stop
    done
    pack
    ;;
  overlap-a)  # async scheduling + fused qk-norm/rope + sampling kernel: bench, GPU tests, bench without overlap
    TAIL=25 bench triton --attention triton --profile
    step gpu_tests_core 150 python -m pytest tests/gpu/test_gpu_engine.py plugins/models_qwen3/tests/test_qk_norm_rope.py \
      tests/unit/test_sampling_kernel.py -m gpu -q -x -k "not flash_attn"
    step kernel_tests_triton 120 python -m pytest plugins/attention_flash/tests/test_gpu_backends.py -m gpu -x -q -k "triton"
    TAIL=5 bench triton_sync --attention triton --async-scheduling off
    ;;
  final2-a)  # this session's final figures (with flash-attn's first half alongside)
    step gpu_tests_core 150 python -m pytest tests/gpu/test_gpu_engine.py plugins/models_qwen3/tests/test_qk_norm_rope.py \
      tests/unit/test_sampling_kernel.py -m gpu -q -s -k "not flash_attn"
    step kernel_tests_triton 120 python -m pytest plugins/attention_flash/tests/test_gpu_backends.py -m gpu -x -q -k "triton"
    TAIL=25 bench triton --attention triton --profile
    TAIL=4 bench triton_sync --attention triton --async-scheduling off
    TAIL=4 bench triton_no_compile --attention triton --no-compile-small-ops
    TAIL=4 bench triton_eager --attention triton --enforce-eager --no-compile-small-ops
    TAIL=4 bench torch_small --attention torch --num-seqs 32 --max-input-len 256 --max-output-len 128
    ;;
  final2-b)
    TAIL=30 step kernel_bench 200 python plugins/attention_flash/bench_kernels.py --out "$OUT/kernels.md"
    step engine_tests_flash 120 python -m pytest tests/gpu/test_gpu_engine.py -m gpu -q -s -k "flash_attn"
    TAIL=4 bench flash_attn --attention flash_attn
    TAIL=4 bench flash_attn_sync --attention flash_attn --async-scheduling off
    step kernel_tests_flash 150 python -m pytest plugins/attention_flash/tests/test_gpu_backends.py -m gpu -x -q -k "flash"
    ;;
  decode-tune)  # the bench without overlap, the decode tile sweep after the block-table prefetch, the bench
    TAIL=4 bench triton_sync --attention triton --async-scheduling off
    TAIL=3 step decode_sweep 200 python plugins/attention_flash/bench_kernels.py --sweep decode --backends triton \
      --out "$OUT/decode_sweep.md"
    TAIL=4 bench triton --attention triton
    ;;
  tp2)  # two H200s (kind nvidia-h200-x2): NCCL TP=2 parity, the workload at TP=2 and TP=1
    step gpu_tests_tp2 200 python -m pytest tests/gpu/test_gpu_engine.py -m gpu -q -s -k "tp2"
    TAIL=4 bench tp2 --attention triton --tensor-parallel-size 2
    TAIL=4 bench tp1 --attention triton
    rm -f "$OUT/pip.log"
    ;;
  overlap-b)  # flash-attn-4 beside it: prefill tile sweep, kernel table, parity, bench
    python -c "import flash_attn.cute; print('flash-attn-4 imports')"
    TAIL=70 step kernel_sweep 240 python plugins/attention_flash/bench_kernels.py --sweep prefill --backends triton,flash_attn --out "$OUT/sweep.md"
    step engine_tests_flash 120 python -m pytest tests/gpu/test_gpu_engine.py -m gpu -q -s -k "flash_attn"
    TAIL=6 bench flash_attn --attention flash_attn
    ;;
  triton)
    step kernel_tests_triton 150 python -m pytest plugins/attention_flash/tests/test_gpu_backends.py -m gpu -x -q -k "triton"
    step engine_tests 150 python -m pytest tests/gpu/test_gpu_engine.py -m gpu -q -s -k "not flash_attn"
    bench triton --attention triton
    TAIL=4 bench triton_eager --attention triton --enforce-eager
    ;;
  final-a)  # the end-to-end numbers of docs/benchmarks.md (first half of flash-attn travels alongside)
    TAIL=6 bench triton --attention triton
    TAIL=4 bench torch_small --attention torch --num-seqs 32 --max-input-len 256 --max-output-len 128
    ;;
  final-b)
    TAIL=6 bench flash_attn --attention flash_attn
    ;;
  compiled)  # after fusing the small ops with torch.compile
    step engine_tests 200 python -m pytest tests/gpu/test_gpu_engine.py -m gpu -q -s -k "not flash_attn"
    TAIL=25 bench triton --attention triton --profile
    TAIL=25 bench triton_uncompiled --attention triton --no-compile-small-ops --profile
    ;;
  flash)
    python -c "import flash_attn.cute; print('flash-attn-4 imports')"
    bench flash_attn --attention flash_attn
    step kernel_bench 200 python plugins/attention_flash/bench_kernels.py --out "$OUT/kernels.md"
    step kernel_tests_flash 150 python -m pytest plugins/attention_flash/tests/test_gpu_backends.py -m gpu -x -q -k "flash"
    step engine_tests_flash 100 python -m pytest tests/gpu/test_gpu_engine.py -m gpu -q -s -k "flash_attn"
    ;;
esac
