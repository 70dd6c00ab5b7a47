#!/usr/bin/env bash
# The GPU checks of GPU decoding (CUDA graphs, eager CUDA, large-shape timing), in one run
# of under 8 minutes on an H200. Needs only torch with CUDA, transformers, safetensors,
# tokenizers, tqdm, matplotlib, psutil and pytest (no install, no download). Prints one summary table at
# the end and writes probe.json, pair_bf16.json, qwen3_8b.json, pair_fp32.json (profile.json) and gpu_check.log
# into OUT_DIR.
#
# Usage: scripts/gpu_check.sh [OUT_DIR] [PARTS]
#   PARTS: comma-separated, default probe,pair,shapes,tests,fp32; also: hybrid (the Qwen3.5-9B
#   shape eager and compiled, a hybrid target's CUDA graphs; about 2 more minutes) and
#   profile (scripts/gpu_profile.py: the Qwen3-8B shape compiled with joined and with
#   separate projections, timed and profiled kernel by kernel into profile.json; about 3
#   more minutes, an estimate: not yet run on a GPU), gptoss (the gpt-oss-20b shape, MXFP4
#   experts dequantized, eager and compiled step/round; about 2 more minutes, an estimate) and
#   fp8 (scripts/fp8_speed.py: target-only decoding of random FP8 targets, dense 2048-wide and
#   MoE, dequantized vs kept FP8 (--fp8 packed); about 2 more minutes, an estimate) and gemma
#   (the gemma-4-31b and gemma-4-26b-a4b shapes, eager and compiled step/round; about 3 more
#   minutes, an estimate)
#
# Each part that fails (a command's non-zero exit, a bench that wrote no bench.json) is
# named at the end, after the other parts have run, and the script then exits 1; it stops at
# once with one line and exit 2 on a usage mistake (an unknown part, an OUT_DIR it cannot
# create), when python or torch cannot run, or when torch sees no CUDA device. A relative
# OUT_DIR is taken from the directory it is called from (default ./gpu_out).
set -uo pipefail
PARTS_KNOWN=probe,pair,shapes,hybrid,gptoss,gemma,fp8,profile,tests,fp32
case "${1:-}" in
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: error: unknown option $1 (usage: scripts/gpu_check.sh [OUT_DIR] [PARTS]; --help)" >&2; exit 2 ;;
esac
if (( $# > 2 )); then
    echo "gpu_check.sh: error: at most 2 arguments, got $# (usage: scripts/gpu_check.sh [OUT_DIR] [PARTS]; --help)" >&2
    exit 2
fi
OUT=${1:-gpu_out}
PARTS=${2:-probe,pair,shapes,tests,fp32}
IFS=, read -ra parts <<< "$PARTS"
for part in "${parts[@]}"; do
    if [[ ",$PARTS_KNOWN," != *",$part,"* ]]; then
        echo "gpu_check.sh: error: unknown part '$part' in '$PARTS'; the parts are $PARTS_KNOWN" >&2
        exit 2
    fi
done
[[ "$OUT" == /* ]] || OUT="$PWD/$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
has() { [[ ",$PARTS," == *",$1,"* ]]; }
if ! $PY -c "" 2>/dev/null; then
    echo "gpu_check.sh: error: python cannot run ($PY; set PYTHON to a python with torch)" >&2
    exit 2
fi
# (one import of torch, ~2 s of CPU: its version and whether it sees a CUDA device, on its last line)
if ! info=$($PY -c "import torch; print(torch.__version__, int(torch.cuda.is_available()))" 2>&1); then
    echo "gpu_check.sh: error: torch is not importable by $PY ($(tail -n 1 <<< "$info"))" >&2
    exit 2
fi
read -r torch_version cuda_seen <<< "$(tail -n 1 <<< "$info")"
# (DEVICE=cpu runs the bench parts on the CPU: a check of this script, not of a GPU)
if [[ "${DEVICE:-cuda}" == cuda* && "$cuda_seen" != 1 ]]; then
    echo "gpu_check.sh: error: no CUDA device ($PY's torch $torch_version sees none); run it on a machine with an NVIDIA GPU and torch built with CUDA" >&2
    exit 2
fi
if ! err=$({ mkdir -p "$OUT" && : >> "$LOG"; } 2>&1); then
    echo "gpu_check.sh: error: cannot write OUT_DIR $OUT ($(tail -n 1 <<< "$err"))" >&2
    exit 2
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
FAILED=()
failed() {  # failed PART: noted in the log now, named again at the end
    FAILED+=("$1")
    echo "gpu_check.sh: part $1 failed (the run goes on)" | tee -a "$LOG"
}
step() { echo "=== $1 ($(date +%T))" | tee -a "$LOG"; }

bench() {  # bench NAME ARGS...: the bench CLI into $WORK/NAME, its bench.json copied to $OUT/NAME.json
    local name=$1; shift
    rm -f "$OUT/$name.json"  # (no earlier run's result in the summary)
    $PY -m dflash_torch bench --device "${DEVICE:-cuda}" --no-progress --out "$WORK/$name" "$@" 2>&1 | tee -a "$LOG" \
        || { failed "$name"; return; }
    cp "$WORK/$name/bench.json" "$OUT/$name.json" 2>/dev/null || { echo "($name wrote no bench.json)" | tee -a "$LOG"; failed "$name"; }
}

if has probe; then
    step "probe: device, copy bandwidth, eager decoding with and without cuDNN attention"
    rm -f "$OUT/probe.json"
    $PY scripts/gpu_probe.py --json "$OUT/probe.json" 2>&1 | tee -a "$LOG" || failed probe
fi
if has pair; then
    step "shipped pair, bf16, 8 held-out prompts x 256 tokens, propose-time sweep"
    bench pair_bf16 --dtype bfloat16 --num-prompts 8 --max-new-tokens 256 \
        --modes target-only,inject,target-only-compiled,inject-compiled --sweep 128,512,2048,8192
fi
if has shapes; then
    step "Qwen3-8B shape, random weights, bf16: eager and compiled step/round, drafter sweep"
    bench qwen3_8b --dtype bfloat16 --num-prompts 1 --max-new-tokens 8 --modes target-only \
        --sweep 128,512,2048,8192 --sweep-shapes qwen3-8b --shapes qwen3-8b --shapes-compiled
fi
if has hybrid; then
    step "Qwen3.5-9B shape (hybrid), random weights, bf16: eager and compiled step/round"
    bench qwen35_9b --dtype bfloat16 --num-prompts 1 --max-new-tokens 8 --modes target-only --sweep "" \
        --shapes qwen3.5-9b --shapes-compiled
fi
if has gptoss; then
    step "gpt-oss-20b shape (sink attention, sliding window, 32 experts), random weights, bf16: eager and compiled step/round"
    bench gptoss_20b --dtype bfloat16 --num-prompts 1 --max-new-tokens 8 --modes target-only --sweep "" \
        --shapes gpt-oss-20b --shapes-compiled
fi
if has gemma; then
    step "Gemma 4 shapes (two head sizes, values from keys, 26B-A4B: experts beside the MLP), random weights, bf16: eager and compiled step/round"
    for shape in gemma-4-31b gemma-4-26b-a4b; do
        bench "${shape//[.-]/_}" --dtype bfloat16 --num-prompts 1 --max-new-tokens 8 --modes target-only --sweep "" \
            --shapes $shape --shapes-compiled
    done
fi
if has fp8; then
    step "FP8 targets (random, 128x128 blocks), bf16, target-only: dequantized vs kept FP8"
    for family in qwen3 qwen3_moe; do
        $PY scripts/fp8_speed.py --device "${DEVICE:-cuda}" --dtype bfloat16 --family $family --hidden 2048 \
            --layers 4 --tokens 64 --reps 2 2>&1 | { grep -v "Writing model shards" || true; } | tee -a "$LOG" \
            || failed "fp8 ($family)"
    done
fi
if has profile; then
    step "Qwen3-8B shape, random weights, bf16, compiled: joined vs separate projections, kernel profile"
    rm -f "$OUT/profile.json"
    $PY scripts/gpu_profile.py --json "$OUT/profile.json" 2>&1 | tee -a "$LOG" || failed profile
fi
if has tests; then
    step "CUDA tests"
    $PY -m pytest -p no:cacheprovider -rN -x tests/test_cuda.py 2>&1 | tee -a "$LOG" || failed tests
fi
if has fp32; then
    step "shipped pair, float32: every mode against target-only"
    bench pair_fp32 --dtype float32 --num-prompts 4 --max-new-tokens 128 \
        --modes target-only,inject,recompute,target-only-compiled,inject-compiled --sweep ""
fi
step "summary"
if compgen -G "$OUT/*.json" > /dev/null; then
    $PY scripts/gpu_summary.py "$OUT" 2>&1 | tee -a "$LOG" || failed summary
else  # (parts that write no result file, e.g. tests alone: nothing to summarize, which is no failure)
    echo "no result files in $OUT: the parts run write none" | tee -a "$LOG"
fi
if (( ${#FAILED[@]} )); then
    printf -v names '%s, ' "${FAILED[@]}"
    echo "gpu_check.sh: error: ${#FAILED[@]} part(s) failed: ${names%, } (see $LOG)" | tee -a "$LOG" >&2
    exit 1
fi
