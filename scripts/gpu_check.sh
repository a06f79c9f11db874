#!/usr/bin/env bash
# The GPU check in one call: every section in order, inside a budget of at most 420 s (scripts/gpu_check/).
#
#   bash scripts/gpu_check.sh [--dry-run] [--only a,b]
#
# Sections (GPU estimate / limit, s): preconditions 8/40, harness 40/110 (the trainer's process group at world
# size 1, FSDP2 with CPU offload, bf16 + fused AdamW, checkpointer and DCP, QLoRA codes, fp16), optimizer8bit
# 15/60 (the sharded 8-bit optimizer's save and its memory), hsdp 10/45 (a (1, 1) mesh), qlora8 10/45 (8-bit
# QLoRA's saved bytes against the plan), pipeline 15/60 (every stage in one process), memory 70/150 (plan vs
# measured: bf16 full, LoRA, QLoRA, 10%), attention 25/80 (4096 tokens: sdpa, sdpa packed, flex packed),
# moe_experts 20/60 (eager, grouped_mm, batched_mm), moe_lora 15/60 (LoRA on the experts, where this build has
# it), compile 60/120, dpo 20/60, chat_eval 25/75, throughput 35/90 (tokens/s, MFU): 368 s planned.
#
# The budget (GPU_CHECK_BUDGET, at most 420) counts from this script's start, the wheels' installation
# included: a section starts only while what is left covers its estimate, and runs under the smaller of its
# limit and what is left; one that does not fit is reported as skipped with the seconds left. A section that
# fails or times out never stops the next. $OUT (default runs/gpu_check) gets two files, rewritten after every
# section: summary.json (every section's status, figures, checks and notes; budget_s, planned_s, elapsed_s)
# and logs.tar.gz (each section's log and JSON). Exit 1 when a section failed or timed out.
#
# --dry-run: every section's CPU path (tiny models, at most 2 training steps) in one process, gloo instead
# of NCCL; what needs CUDA is reported as such. tests/e2e/test_gpu_check.py runs it.
#
# On this workplace's lent H200 (no network there; docs/gpu.md):
#   here:   bash scripts/gpu_wheels.sh
#   there:  run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=450)
set -uo pipefail
cd "$(dirname "$0")/.."
export GPU_CHECK_STARTED="${GPU_CHECK_STARTED:-$EPOCHREALTIME}"

dry=() only=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=(--dry-run) ;;
    --only) only=(--only "${2:-}"); shift ;;
    --only=*) only=(--only "${1#--only=}") ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --only a,b)" >&2; exit 2 ;;
  esac
  shift
done

PY="${PYTHON:-python3}"
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
# The sections' scratch files (models, runs, checkpoints, logs before packing): a fresh folder, removed at the
# end unless given.
if [ -z "${GPU_CHECK_WORK:-}" ]; then
  GPU_CHECK_WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
  trap 'rm -rf "$GPU_CHECK_WORK"' EXIT
fi
mkdir -p "$GPU_CHECK_WORK/logs"
export GPU_CHECK_WORK PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ ${#dry[@]} -eq 0 ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$GPU_CHECK_WORK/logs/setup.log" 2>&1 || echo "gpu_check.sh: installing .whl failed (logs.tar.gz: setup.log)"
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
[ ${#dry[@]} -eq 0 ] && { nvidia-smi > "$GPU_CHECK_WORK/logs/nvidia-smi.log" 2>&1 || true; }
"$PY" -m scripts.gpu_check check --out "$OUT" --work "$GPU_CHECK_WORK" "${dry[@]}" "${only[@]}"
