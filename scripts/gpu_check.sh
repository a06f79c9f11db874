#!/usr/bin/env bash
# The GPU check in timed sections (scripts/gpu_check/: the sections' code and their table).
#
#   bash scripts/gpu_check.sh [--dry-run] [--part 1|2|all] [--only a,b]
#
# Each section runs in its own process under its own limit (`timeout`), writes $OUT/<section>.json (status
# ok | failed | timed out | skipped, with the reason; its figures and checks) and $OUT/logs/<section>.log; a
# failed or timed-out section never stops the next. The end: a summary table on stdout and $OUT/summary.json
# (exit 1 when a section failed or timed out). $OUT defaults to runs/gpu_check.
#
# Part 1 (limits 420 s with the setup; estimated ~4 min on one H200):
#   preconditions  45 s (est. 15)   versions, carried wheels, bitsandbytes' CUDA binary, device -> gpu_type -> peak
#   harness       110 s (est. 55)   FSDP2, DCP, fused AdamW, QLoRA all-gather, fp16 GradScaler over NCCL, world 1
#   memory        245 s (est. 170)  plan vs measured: full/LoRA/QLoRA 4-bit/8-bit x bf16/fp16, eval, a resume
# Part 2 (limits 420 s with the setup; estimated ~4.5 min):
#   optimizer8bit  70 s (est. 40)   adamw8bit against adamw
#   compile       110 s (est. 75)   train.compile + LoRA + activation checkpointing, 12 blocks
#   attention      60 s (est. 35)   flex attention's loss against sdpa's and eager's on one batch
#   vocab          45 s (est. 25)   a 128256-token vocabulary through the fused head
#   smollm2       115 s (est. 80)   SmolLM2-135M tokens/s and MFU against TRL's SFTTrainer (skipped without trl)
#
# --dry-run: every section's CPU-possible part (the harness on gloo, two-step CLI runs of a micro model), two
# sections at a time (GPU_CHECK_JOBS); what needs CUDA is skipped with the reason. tests/e2e/test_gpu_check.py
# runs it.
#
# On this workplace's lent H200 (no network there; two calls of at most 7 minutes each):
#   here:   bash scripts/gpu_wheels.sh
#   there:  run(command="bash scripts/gpu_check.sh --part 1", carry=[".whl"], timeout_s=450)
#           run(command="bash scripts/gpu_check.sh --part 2", carry=[".whl"], timeout_s=450)
# At most 8 files come back from $OUT: a part's JSONs, summary.json and logs.tar.gz (the logs, packed).
set -uo pipefail
cd "$(dirname "$0")/.."

part=all dry=() only=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=(--dry-run) ;;
    --part) part="${2:-}"; shift ;;
    --part=*) part="${1#--part=}" ;;
    --only) only=(--only "${2:-}"); shift ;;
    --only=*) only=(--only "${1#--only=}") ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --part 1|2|all, --only a,b)" >&2; exit 2 ;;
  esac
  shift
done
case "$part" in 1|2|all) ;; *) echo "gpu_check.sh: --part takes 1, 2 or all, not '$part'" >&2; exit 2 ;; esac

PY="${PYTHON:-python3}"
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
started=$EPOCHREALTIME
if [ ${#dry[@]} -eq 0 ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/logs/setup.log" 2>&1 || echo "gpu_check.sh: installing .whl failed (see logs/setup.log)"
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# The sections' scratch files (models, runs, checkpoints): a fresh folder, removed at the end unless given.
if [ -z "${GPU_CHECK_WORK:-}" ]; then
  GPU_CHECK_WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
  trap 'rm -rf "$GPU_CHECK_WORK"' EXIT
fi
export GPU_CHECK_WORK
[ ${#dry[@]} -eq 0 ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; }

# A part must end inside one 7-minute call: a section that could not finish inside what is left is not started.
budget="${GPU_CHECK_BUDGET:-420}"
[ "$part" = all ] || [ ${#dry[@]} -gt 0 ] && budget=0
# On the GPU one section at a time (each measures the device alone); the dry run's sections, mostly one
# single-threaded process each, run two at a time on a CPU's cores.
parallel="${GPU_CHECK_JOBS:-1}"
[ ${#dry[@]} -gt 0 ] && parallel="${GPU_CHECK_JOBS:-2}"

run_section() {  # NAME LIMIT: one section under its limit, then its JSON completed with how it ended
  local name=$1 limit=$2 begun=$EPOCHREALTIME rc seconds
  echo "== $name (limit ${limit} s)"
  rm -f "$OUT/$name.json"  # one left in OUT by another run of this section must not stand for this one
  timeout -k 10 "$limit" "$PY" -m scripts.gpu_check run "$name" --out "$OUT" "${dry[@]}" \
    > "$OUT/logs/$name.log" 2>&1 < /dev/null
  rc=$?
  seconds=$(awk -v a="$begun" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  "$PY" -m scripts.gpu_check end "$name" --out "$OUT" --rc "$rc" --seconds "$seconds" "${dry[@]}"
  echo "   $name: exit $rc after ${seconds} s"
}

listing="$("$PY" -m scripts.gpu_check sections --part "$part" "${dry[@]}" "${only[@]}")" || exit 2
while read -r name limit; do
  [ -n "$name" ] || continue
  spent=$(awk -v a="$started" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }')
  if [ "$budget" -gt 0 ] && [ $((spent + limit)) -gt "$budget" ]; then
    echo "== $name: not started ($spent s spent, its limit $limit s would pass the part's $budget s)"
    "$PY" -m scripts.gpu_check end "$name" --out "$OUT" --rc 0 --seconds 0 "${dry[@]}" \
      --skip "not started: ${spent} s spent + its ${limit} s limit > the part's ${budget} s"
    continue
  fi
  if [ "$parallel" -gt 1 ]; then
    while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n; done
    run_section "$name" "$limit" &
  else
    run_section "$name" "$limit"
  fi
done <<< "$listing"
wait

"$PY" -m scripts.gpu_check summary --out "$OUT" --part "$part" "${dry[@]}" "${only[@]}"
status=$?
if [ ${#dry[@]} -eq 0 ]; then
  tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
fi
exit $status
