#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md, in two phases on one warm H200 machine (see docs/benchmarks.md):
#   bash benchmarks/gpu_session.sh triton   # Triton kernels: tests, engine parity, end-to-end bench
#   bash benchmarks/gpu_session.sh flash    # flash-attn-4: tests, kernel micro-benchmarks, end-to-end bench
# Needs PYTHONPATH with pydantic (and flash-attn-4 for phase flash). Logs and tables go to $OUT.
set -u
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation --no-index -e . -e plugins/scheduler_fifo \
  -e plugins/attention_flash -e plugins/models_qwen3 > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee -a "$OUT/gpu.txt"
step() {  # step NAME SECONDS COMMAND...: run with a limit, keep the log, print its tail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"; tail -n "${TAIL:-12}" "$OUT/$name.log"
}
bench() {  # bench NAME ARGS...: the nano-vllm workload through `nanovllm bench`
  local name=$1; shift
  step "bench_$name" "${BENCH_LIMIT:-200}" python -m nanovllm_core.cli bench --json "$OUT/bench_$name.json" "$@"
}
case "${1:?phase}" in
  overlap-a)  # async scheduling + fused qk-norm/rope + sampling kernel: bench, GPU tests, bench without overlap
    TAIL=25 bench triton --attention triton --profile
    step gpu_tests_core 150 python -m pytest tests/test_gpu_engine.py plugins/models_qwen3/tests/test_qk_norm_rope.py \
      tests/test_sampling_kernel.py -m gpu -q -x -k "not flash_attn"
    step kernel_tests_triton 120 python -m pytest plugins/attention_flash/tests/test_gpu_backends.py -m gpu -x -q -k "triton"
    TAIL=5 bench triton_sync --attention triton --async-scheduling off
    ;;
  final2-a)  # this session's final figures (with flash-attn's first half alongside)
    step gpu_tests_core 150 python -m pytest tests/test_gpu_engine.py plugins/models_qwen3/tests/test_qk_norm_rope.py \
      tests/test_sampling_kernel.py -m gpu -q -s -k "not flash_attn"
    step kernel_tests_triton 120 python -m pytest plugins/attention_flash/tests/test_gpu_backends.py -m gpu -x -q -k "triton"
    TAIL=25 bench triton --attention triton --profile
    TAIL=4 bench triton_sync --attention triton --async-scheduling off
    TAIL=4 bench triton_no_compile --attention triton --no-compile-small-ops
    TAIL=4 bench triton_eager --attention triton --enforce-eager --no-compile-small-ops
    TAIL=4 bench torch_small --attention torch --num-seqs 32 --max-input-len 256 --max-output-len 128
    ;;
  final2-b)
    TAIL=30 step kernel_bench 200 python plugins/attention_flash/bench_kernels.py --out "$OUT/kernels.md"
    step engine_tests_flash 120 python -m pytest tests/test_gpu_engine.py -m gpu -q -s -k "flash_attn"
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
    step gpu_tests_tp2 200 python -m pytest tests/test_gpu_engine.py -m gpu -q -s -k "tp2"
    TAIL=4 bench tp2 --attention triton --tensor-parallel-size 2
    TAIL=4 bench tp1 --attention triton
    rm -f "$OUT/pip.log"
    ;;
  overlap-b)  # flash-attn-4 beside it: prefill tile sweep, kernel table, parity, bench
    python -c "import flash_attn.cute; print('flash-attn-4 imports')"
    TAIL=70 step kernel_sweep 240 python plugins/attention_flash/bench_kernels.py --sweep prefill --backends triton,flash_attn --out "$OUT/sweep.md"
    step engine_tests_flash 120 python -m pytest tests/test_gpu_engine.py -m gpu -q -s -k "flash_attn"
    TAIL=6 bench flash_attn --attention flash_attn
    ;;
  triton)
    step kernel_tests_triton 150 python -m pytest plugins/attention_flash/tests/test_gpu_backends.py -m gpu -x -q -k "triton"
    step engine_tests 150 python -m pytest tests/test_gpu_engine.py -m gpu -q -s -k "not flash_attn"
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
    step engine_tests 200 python -m pytest tests/test_gpu_engine.py -m gpu -q -s -k "not flash_attn"
    TAIL=25 bench triton --attention triton --profile
    TAIL=25 bench triton_uncompiled --attention triton --no-compile-small-ops --profile
    ;;
  flash)
    python -c "import flash_attn.cute; print('flash-attn-4 imports')"
    bench flash_attn --attention flash_attn
    step kernel_bench 200 python plugins/attention_flash/bench_kernels.py --out "$OUT/kernels.md"
    step kernel_tests_flash 150 python -m pytest plugins/attention_flash/tests/test_gpu_backends.py -m gpu -x -q -k "flash"
    step engine_tests_flash 100 python -m pytest tests/test_gpu_engine.py -m gpu -q -s -k "flash_attn"
    ;;
esac
