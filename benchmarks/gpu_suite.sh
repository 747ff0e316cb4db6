#!/usr/bin/env bash
# The GPU benchmarks (and optionally the `cuda` tests) in one command, for one lease of
# the GPU machine. Each part runs under its own time limit so that one slow part cannot
# take the others' results with it; logs and benchmarks/results/*.json end up in
# DEST (default: $OUT, else benchmarks/results/suite) as at most 8 files (`tests` writes
# one log per pytest process beside the mode's log).
#
#   bash benchmarks/gpu_suite.sh sweep   # launch sweeps: the Gluon prefill's stages, decode --sweep,
#                                        # plan host time, decoder step, MLA decode --tune (16
#                                        # and 128 heads)
#   bash benchmarks/gpu_suite.sh tests   # the `-m cuda` tests of npu-attention and npu-graphs
#                                        # (four processes at once: 4 minutes on a fresh H100 machine)
#   bash benchmarks/gpu_suite.sh final   # every benchmark at its defaults, and the 8-bit
#                                        # caches' decode (int8_per_token_head, fp8,
#                                        # fp8_per_token_head; token- and head-major pages) and
#                                        # prefill (int8_per_token_head, fp8), each beside the
#                                        # 16-bit cache in its process
#   bash benchmarks/gpu_suite.sh kv8     # 8-bit KV caches: their `cuda` tests (GQA and the MLA
#                                        # fp8 latent cache, three processes), then decode and
#                                        # prefill of int8_per_token_head, fp8 and
#                                        # fp8_per_token_head against the 16-bit cache
#                                        # (KV8_PARTS, KV8_VARIANTS: a subset, decode settings)
#   bash benchmarks/gpu_suite.sh mla     # the MLA benchmarks: prefill, decode at 16 and 128
#                                        # heads, 1 to 4 query tokens a request (FlashMLA beside
#                                        # them where a `flash_mla` module is on PYTHONPATH)
#
# Each mode stays under 580 s (the parts' limits add up to that), inside one 10-minute
# command; a part cut off at its limit loses only its own JSON.
set -u
mode=${1:-final}
cd "$(dirname "$0")/.."
dest=${DEST:-${OUT:-benchmarks/results/suite}}
mkdir -p "$dest" benchmarks/results
export PYTHONUNBUFFERED=1
export PYTHONPATH=packages/npu-attention/src:packages/npu-graphs/src${PYTHONPATH:+:$PYTHONPATH}
log="$dest/$mode.log"
: >"$log"

part() {  # part NAME SECONDS COMMAND...; its output goes to $part_log (default: the mode's log)
    local name=$1 seconds=$2 out=${part_log:-$log}
    shift 2
    echo "=== $name ($(date -u +%T), limit ${seconds}s): $*" | tee -a "$out"
    local start=$SECONDS
    timeout --kill-after=2 "$seconds" "$@" >>"$out" 2>&1
    echo "=== $name: exit $? after $((SECONDS - start))s" | tee -a "$out"
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >>"$log" 2>&1
case $mode in
    sweep)
        part prefill_hopper 150 python benchmarks/bench_hopper_prefill.py --variants all
        part decode_sweep 180 python benchmarks/bench_decode_attention.py --sweep
        part plan_host 60 python benchmarks/bench_decoder_step.py --plan-only
        part decoder_step 90 python benchmarks/bench_decoder_step.py --steps 30
        part mla_decode 40 python benchmarks/bench_mla_decode.py --tune
        part mla_decode_128 60 python benchmarks/bench_mla_decode.py --tune --heads 128
        ;;
    tests)  # four pytest processes at once: compiling the Triton variants is the long part
        attention=packages/npu-attention/tests
        triton_rest="$attention/test_triton_plan_run.py $attention/test_triton_context_parallel.py
            $attention/test_triton_hopper_prefill.py $attention/test_triton_hopper_decode.py
            $attention/test_triton_hopper_mla_decode.py
            $attention/test_triton_hopper_mla_wide_decode.py"
        pytest_cuda=(python -m pytest -q -m cuda -ra -p no:cacheprovider --durations=5)
        part_log=$dest/tests_provider.log part tests_provider 560 "${pytest_cuda[@]}" \
            "$attention/test_triton_provider.py" -k "not gpu_head_sizes" &
        part_log=$dest/tests_head_sizes.log part tests_head_sizes 560 "${pytest_cuda[@]}" \
            "$attention/test_triton_provider.py" -k gpu_head_sizes &
        # shellcheck disable=SC2086 (lists of paths)
        part_log=$dest/tests_triton_rest.log part tests_triton_rest 560 "${pytest_cuda[@]}" \
            $triton_rest &
        # shellcheck disable=SC2046,SC2086
        part_log=$dest/tests_others.log part tests_others 560 "${pytest_cuda[@]}" \
            "$attention" packages/npu-graphs/tests \
            --ignore="$attention/test_triton_provider.py" $(printf -- '--ignore=%s ' $triton_rest) &
        wait
        ;;
    final)
        part prefill 70 python benchmarks/bench_prefill_attention.py
        part mla_prefill 30 python benchmarks/bench_mla_prefill.py
        part decode 110 python benchmarks/bench_decode_attention.py
        for kind in int8_per_token_head fp8 fp8_per_token_head; do  # both page orders
            part "decode_$kind" 55 python benchmarks/bench_decode_attention.py \
                --kv-cache-dtype "$kind" --rounds 2
        done
        for kind in int8_per_token_head fp8; do
            part "prefill_$kind" 45 python benchmarks/bench_prefill_attention.py \
                --kv-cache-dtype "$kind"
        done
        part decoder_step 50 python benchmarks/bench_decoder_step.py --steps 30
        part mla_decode 30 python benchmarks/bench_mla_decode.py
        part mla_decode_128 35 python benchmarks/bench_mla_decode.py --heads 128
        ;;
    mla)
        part mla_prefill 60 python benchmarks/bench_mla_prefill.py
        part mla_decode 50 python benchmarks/bench_mla_decode.py
        part mla_decode_spec 50 python benchmarks/bench_mla_decode.py --tokens 3 4 --batches 64
        part mla_decode_128 60 python benchmarks/bench_mla_decode.py --heads 128
        part mla_decode_128_spec 80 python benchmarks/bench_mla_decode.py --heads 128 \
            --tokens 1 2 3 4 --batches 64
        ;;
    kv8)  # KV8_PARTS: which of tests, decode, prefill (default: all three)
        parts=${KV8_PARTS:-tests decode prefill}
        if [[ $parts == *tests* ]]; then  # three pytest processes at once
            attention=packages/npu-attention/tests
            pytest_cuda=(python -m pytest -q -m cuda -ra -p no:cacheprovider --durations=5)
            part_log=$dest/tests_kv8.log part tests_kv8 180 "${pytest_cuda[@]}" \
                "$attention/test_triton_kv_quant.py" -k "not hopper_decode_over_8bit_pages" &
            part_log=$dest/tests_kv8_hopper.log part tests_kv8_hopper 180 "${pytest_cuda[@]}" \
                "$attention/test_triton_kv_quant.py" -k hopper_decode_over_8bit_pages &
            part_log=$dest/tests_kv8_mla.log part tests_kv8_mla 180 "${pytest_cuda[@]}" \
                "$attention/test_mla_triton_kv_quant.py" &
            wait
        fi
        if [[ $parts == *decode* ]]; then
            for kind in int8_per_token_head fp8 fp8_per_token_head; do
                part "decode_$kind" 80 python benchmarks/bench_decode_attention.py \
                    --kv-cache-dtype "$kind" --rounds 2 ${KV8_VARIANTS:+--kv-variants "$KV8_VARIANTS"}
            done
        fi
        if [[ $parts == *prefill* ]]; then
            for kind in int8_per_token_head fp8; do
                part "prefill_$kind" 60 python benchmarks/bench_prefill_attention.py --kv-cache-dtype "$kind"
            done
        fi
        ;;
    *)
        echo "usage: $0 sweep|tests|final|mla|kv8" >&2
        exit 2
        ;;
esac
# One archive of the JSON results (the file count that comes back is limited).
tar -czf "$dest/$mode-results.tar.gz" -C benchmarks/results \
    $(cd benchmarks/results && ls *.json 2>/dev/null) 2>>"$log"
