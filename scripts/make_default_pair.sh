#!/usr/bin/env bash
# Reproduce the shipped default pair (dflash_torch/assets/default/) on a 2-core CPU machine.
# See dflash_torch/assets/default/README.md for what each step produced.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/dflash_default_pair}
mkdir -p "$WORK"

# 1. Tokenizer + target (Qwen3 architecture, 5.8M parameters) on the CPython stdlib train split.
#    The shipped target ran 400 steps of an 800-step schedule, then was resumed with
#    --resume --max-steps 560 (the machine was shared); this single command runs the
#    same recipe with a 560-step schedule.
python scripts/train_default_target.py --max-steps 560 --time-budget-min 600 --work-dir "$WORK/target_work"

# 2. The train split as JSONL (the held-out modules are excluded by scripts/default_corpus.py).
python - "$WORK/train.jsonl" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from default_corpus import corpus_files, read_source
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for path in corpus_files("train"):
        text = read_source(path)
        if text and text.strip():
            out.write(json.dumps({"text": text}) + "\n")
PY

# 3a. The DFlash (v1) drafter, kept in drafter-dflash1/ for comparison: 3 layers started from
#     the target's last 3 layers (--init-from-target), B=16, 2000 self-distilled sequences (the
#     target's greedy continuations of train-split prefixes) plus 20% raw text, one 55-minute
#     cosine schedule (1405 steps on its run, an Intel CPU with AMX, bf16 autocast).
#     The schedule follows the clock, so a faster or slower machine runs more or fewer steps.
dflash-torch train --target dflash_torch/assets/default/target --data "$WORK/train.jsonl" \
  --out "$WORK/drafter-dflash1" --work-dir "$WORK/drafter_work" --num-layers 3 --init-from-target --block-size 16 \
  --self-distill 2000 --self-distill-batch 64 --prefix-min 64 --prefix-max 256 --raw-fraction 0.2 \
  --batch 8 --seq-len 512 --anchors-per-seq 64 --lr 3e-3 --warmup-steps 20 --eval-every 100 --ckpt-every 50 \
  --threads 2 --seed 0 --time-budget-min 55
mkdir -p dflash_torch/assets/default/drafter-dflash1
cp "$WORK/drafter-dflash1/config.json" "$WORK/drafter-dflash1/model.safetensors" \
  "$WORK/drafter-dflash1/training_log.json" dflash_torch/assets/default/drafter-dflash1/

# 3b. The default drafter, DFlash 2 (--arch dflash2): the same recipe and 55-minute budget, in
#     float32 (--no-autocast: its machine, an AMD EPYC with AVX2 only, runs bf16 autocast ~11x
#     slower), 300 self-distilled sequences instead of 2000 (2000 take ~85 min there), no
#     validation split; 532 steps on its run.
dflash-torch train --arch dflash2 --target dflash_torch/assets/default/target --data "$WORK/train.jsonl" \
  --out "$WORK/drafter" --work-dir "$WORK/drafter2_work" --num-layers 3 --init-from-target --block-size 16 \
  --self-distill 300 --self-distill-batch 64 --prefix-min 64 --prefix-max 256 --raw-fraction 0.2 \
  --batch 8 --seq-len 512 --anchors-per-seq 64 --lr 3e-3 --warmup-steps 20 --val-seqs 0 --ckpt-every 50 \
  --threads 2 --seed 0 --time-budget-min 55 --no-autocast
mkdir -p dflash_torch/assets/default/drafter
cp "$WORK/drafter/config.json" "$WORK/drafter/model.safetensors" "$WORK/drafter/training_log.json" \
  dflash_torch/assets/default/drafter/

# 4. Acceptance and identity on the 64 held-out prompts.
python scripts/eval_default_pair.py --out "$WORK/eval.json"
python scripts/eval_default_pair.py --draft dflash_torch/assets/default/drafter-dflash1 --out "$WORK/eval-dflash1.json"
