#!/usr/bin/env bash
# Run HERE (where pip reaches PyPI), before scripts/gpu_check.sh on the lent GPU machine: downloads into .whl/
# the wheels for Python 3.12 that machine's image lacks. It has torch 2.11, transformers 5.17 (both at
# pyproject's floors: they are used as they are), peft, accelerate, typer, rich, pyyaml, safetensors, pyarrow,
# huggingface-hub, xxhash, but not pydantic, datasets or bitsandbytes, and nothing can be fetched there. peft is
# carried too, at the version the suite runs with (the image's is not known). bitsandbytes' manylinux wheel
# keeps only its CUDA 13 binary (the image's torch is built for CUDA 13.0). About 12 MiB in all, under the
# 64 MiB a call may carry; .gitignore keeps .whl/ out of git (the device tool carries it when named). Then:
# run(command="bash scripts/gpu_check.sh", carry=[".whl"]) (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
PIP_CONSTRAINT= python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.2 peft==0.21.2
python3 -m scripts.gpu_check slim-wheel .whl/bitsandbytes-*.whl --keep cuda13
du -sh .whl
size=$(du -sb .whl | cut -f1)
[ "$size" -le $((64 * 1024 * 1024)) ] || { echo "gpu_wheels.sh: .whl is $size bytes, over the 64 MiB a call carries" >&2; exit 1; }
