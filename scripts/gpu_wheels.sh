#!/usr/bin/env bash
# Run HERE (where pip reaches PyPI), before scripts/gpu_check.sh on the lent GPU machine: downloads into .whl/
# the wheels that machine's image lacks (it has torch, transformers, peft, typer, rich, pyyaml, safetensors,
# accelerate, pyarrow, but not pydantic, datasets or bitsandbytes; nothing can be fetched there). ~47 MB, under
# the 64 MiB the working tree may carry. Then: run(command="bash scripts/gpu_check.sh", carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.2 peft==0.21.2
du -sh .whl
