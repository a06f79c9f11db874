#!/usr/bin/env bash
# pyproject's dependency floors, true at both ends: a venv with exactly the floors trains through the CLI, and a
# venv with the newest releases the registry serves passes the fast tier.
#
#   bash scripts/check_versions.sh [floors|newest|all]      (default: all)
#
# floors  a venv where every dependency is pinned to its pyproject floor (`name>=X` -> `name==X`, torch and
#         transformers included): the installed versions and what finetune.versions detects; the unit test of
#         the floors (tests/unit/test_versions.py); then through the real CLI a 3-step quickstart (full
#         fine-tuning, fp32, with its evaluation) and a 3-step LoRA run on its output under DDP on 2 processes
#         (gloo), a merge and a chat reply of the adapter.
# newest  a venv with the newest torch, transformers and every other dependency the registry serves (no
#         constraint file), the package with its test, smollm2 and eval extras: the fast tier (`pytest`).
#
# Each phase prints its commands and a closing line "PHASE: ok|failed after N s"; the script exits non-zero when
# a phase failed. Logs and venvs go to $CHECK_VERSIONS_DIR (default ${TMPDIR:-/tmp}/finetune-versions; a venv
# is reused when it exists: remove it to rebuild). Torch other than the CPU build is a multi-GB download
# (its CUDA libraries): set PIP_FIND_LINKS=DIR to reuse wheels fetched once with `pip download`. The last run's
# output is in docs/benchmarks.md ("Dependency floors and the newest releases").
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
what="${1:-all}"
case "$what" in floors|newest|all) ;; *) echo "check_versions.sh: floors, newest or all, not '$what'" >&2; exit 2 ;; esac

PY="${PYTHON:-python3}"
DIR="${CHECK_VERSIONS_DIR:-${TMPDIR:-/tmp}/finetune-versions}"
mkdir -p "$DIR"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
failed=()

step() {  # a command, shown, run and timed; its failure fails the phase
  local begun=$SECONDS rc=0
  echo "\$ $*"
  "$@" || rc=$?
  echo "   ($((SECONDS - begun)) s)"
  [ "$rc" -eq 0 ] || { echo "FAILED ($rc): $*"; return 1; }
}

venv() {  # DEST CONSTRAINTS: a venv (reused when there) whose pip resolves under CONSTRAINTS
  local dest=$1
  if [ ! -x "$dest/bin/python" ]; then
    step "$PY" -m venv "$dest" && step "$dest/bin/python" -m pip install -q --upgrade pip || return 1
  fi
  # Our constraints alone: a machine's own pip constraint file (a cap on torch, say) must not pick the versions.
  export PIP_CONSTRAINT="$2" PIP_DISABLE_PIP_VERSION_CHECK=1
}

floors() {
  local v="$DIR/floors" out="$DIR/floors-runs" cons="$DIR/floors.txt"
  # Every `name>=X` of [project].dependencies as `name==X`.
  "$PY" - "$ROOT/pyproject.toml" > "$cons" <<'EOF' || return 1
import re, sys
text = open(sys.argv[1]).read()
deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
for name, floor in re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9][^",;\s]*)"', deps):
    print(f"{name}=={floor}")
EOF
  echo "floors: $(tr '\n' ' ' < "$cons")"
  venv "$v" "$cons" || return 1
  step "$v/bin/python" -m pip install -q -e "$ROOT" pytest pytest-xdist || return 1
  step "$v/bin/python" -c "import json, finetune.versions as v; print(json.dumps(v.report()))" || return 1
  step "$v/bin/python" -m pytest -q -n 0 -p no:cacheprovider tests/unit/test_versions.py || return 1
  rm -rf "$out" && mkdir -p "$out"
  local ft="$v/bin/finetune" few=(--set train.max_steps=3 --set eval.every=3 --set eval.max_samples=8
                                  --set output.log_every=1 --overwrite)
  export FINETUNE_CACHE="$out/cache"
  step "$ft" run recipes/quickstart.yaml "${few[@]}" --set output.dir="$out/quickstart" || return 1
  step "$ft" run recipes/quickstart-lora.yaml "${few[@]}" --nproc 2 --set distributed.strategy=ddp \
    --set model.path="$out/quickstart" --set output.dir="$out/lora" || return 1
  step "$ft" merge "$out/lora" --out "$out/merged" || return 1
  step "$ft" chat "$out/lora" --prompt $'Reverse the letters in capitals.\nabc' --max-new-tokens 4 || return 1
  for run in quickstart lora; do  # the steps' losses, as metrics.jsonl has them
    "$v/bin/python" -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]; \
print(sys.argv[2], 'losses', [round(r['loss'], 4) for r in rows if 'loss' in r])" "$out/$run/metrics.jsonl" "$run"
  done
}

newest() {
  local v="$DIR/newest" none="$DIR/no-constraints.txt"
  : > "$none"
  venv "$v" "$none" || return 1
  step "$v/bin/python" -m pip install -q --upgrade --upgrade-strategy eager torch transformers peft datasets \
    bitsandbytes -e "$ROOT[test,smollm2,eval]" || return 1
  step "$v/bin/python" -c "import json, finetune.versions as v; print(json.dumps(v.report()))" || return 1
  [ -d "$HOME/.cache/finetune/models/smollm2-135m-instruct" ] || step "$v/bin/python" scripts/get_smollm2.py
  step "$v/bin/python" -m pytest -q -p no:cacheprovider || return 1
}

for phase in floors newest; do
  [ "$what" = all ] || [ "$what" = "$phase" ] || continue
  echo "== $phase ($(date -u +%Y-%m-%dT%H:%MZ))"
  started=$SECONDS
  ( "$phase" ) 2>&1 | tee "$DIR/$phase.log"
  rc=${PIPESTATUS[0]}
  result=ok
  [ "$rc" -eq 0 ] || { result=failed; failed+=("$phase"); }
  echo "$phase: $result after $((SECONDS - started)) s (log: $DIR/$phase.log)"
done
((${#failed[@]} == 0)) || { echo "failed: ${failed[*]}" >&2; exit 1; }
