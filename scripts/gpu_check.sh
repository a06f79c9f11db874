#!/usr/bin/env bash
# On a machine with a CUDA GPU: the plan against torch.cuda.max_memory_allocated for a ~0.7B Llama-shaped
# model with random weights (nothing downloaded), bf16: full fine-tuning, LoRA, QLoRA and full with
# activation checkpointing, one optimizer step each through the real trainer (`finetune run`).
# Prints predicted / measured per configuration (prediction without the runtime overhead, which
# max_memory_allocated does not see). Takes a few minutes; writes gpu_check.json in the current directory.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python scripts/plan_accuracy.py --gpu --json "${1:-gpu_check.json}"
