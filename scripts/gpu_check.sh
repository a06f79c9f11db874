#!/usr/bin/env bash
# On a machine with a CUDA GPU: the plan against torch.cuda.max_memory_allocated for a ~0.7B Llama-shaped
# model with random weights (nothing downloaded), bf16: full fine-tuning, LoRA, QLoRA and full with
# activation checkpointing, and LoRA in fp16 (loss scaling), 8 optimizer steps each through the real trainer
# (`finetune run`), with tokens/s and the MFU the run logged (metrics.jsonl `mfu`) after two warm-up steps.
# Prints predicted / measured per configuration (prediction without the runtime overhead, which
# max_memory_allocated does not see). Takes a few minutes; writes gpu_check.json (or $1; under $OUT when set).
# On this workplace's lent H200: first `bash scripts/gpu_wheels.sh` here, then run it there with carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers, peft, bitsandbytes, datasets, pydantic; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'peft', peft.__version__, 'bitsandbytes', bitsandbytes.__version__)"
out="${1:-${OUT:-.}/gpu_check.json}"
python3 scripts/plan_accuracy.py --gpu --steps 8 --json "$out"
python3 scripts/gpu_memory_errors.py   # preflight refusal and the OOM message with --debug-memory
# eager vs train.compile vs flex attention tokens/s, packed rows of 2048 tokens (tiny Llama: kernels, not FLOPs)
python3 scripts/bench_variants.py --max-seq-len 2048 --batch 8 --steps 12 --json "${out%.json}_variants.json"
