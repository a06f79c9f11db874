#!/usr/bin/env bash
# Run HERE (where pip reaches PyPI), before scripts/gpu_check.sh on the lent GPU machine: downloads into .whl/
# the wheels that machine's image lacks (it has torch, transformers 5.17, peft, typer, rich, pyyaml, safetensors,
# accelerate, pyarrow, but not pydantic, datasets, bitsandbytes or trl; nothing can be fetched there), with the
# transformers pyproject asks for, and SmolLM2's tokenizer when scripts/get_smollm2.py has run here. bitsandbytes'
# wheel keeps only its CUDA 13 binaries (the image's torch is built for CUDA 13.0): ~25 MB in all, under the
# 64 MiB the working tree may carry. Then: run(command="bash scripts/gpu_check.sh --part 1", carry=[".whl"]),
# and --part 2 (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.2 peft==0.21.2 \
  transformers==5.24.0 regex==2026.11.19 trl==1.16.0
python3 -m scripts.gpu_check slim-wheel .whl/bitsandbytes-*.whl --keep cuda13
smollm2="${FINETUNE_SMOLLM2:-$HOME/.cache/finetune/models/smollm2-135m-instruct}"
if [ -f "$smollm2/tokenizer.json" ]; then
  mkdir .whl/smollm2 && cp "$smollm2"/{config.json,tokenizer.json,tokenizer_config.json} .whl/smollm2/
  cp "$smollm2"/{chat_template.jinja,generation_config.json} .whl/smollm2/ 2>/dev/null || true
fi
du -sh .whl
