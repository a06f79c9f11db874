"""Benchmark `finetune export --format gguf` (a LoRA adapter folded and written one tensor at a time) against
the whole-model way (transformers loads the base, peft merges the adapter in memory, every tensor converted
before writing), side by side: peak host memory above the imports, and seconds.

    python scripts/bench_export.py [--hidden 1024 --layers 12 --intermediate 4096]

The model is a seeded random Llama in fp32 (tiny-llama's tokenizer) with a random LoRA adapter on every linear
layer, built in a temporary directory; each way runs in its own process (peak RSS is a process's own).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = "import torch, transformers, peft, gguf, numpy; from finetune.commands import export"

STREAMED = """
from pathlib import Path
from finetune.commands.export import ExportOptions, run_export
run_export(ExportOptions(sys.argv[1], Path(sys.argv[2])))
"""
# The whole-model way: the merged model in memory, then every tensor converted before the file is written.
WHOLE = """
import numpy as np
from peft import PeftModel
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained(sys.argv[3], dtype=torch.float32)
merged = PeftModel.from_pretrained(base, sys.argv[1]).merge_and_unload()
arrays = {k: v.numpy().astype(np.float16 if v.ndim > 1 else np.float32) for k, v in merged.state_dict().items()}
w = gguf.GGUFWriter(sys.argv[2], "llama")
for k, a in arrays.items():
    w.add_tensor(k, a)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
"""
MEASURE = """
import resource, sys, time
{imports}
t = time.perf_counter()
imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
{body}
print(imported, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter() - t)
"""


def build(d: Path, hidden: int, layers: int, intermediate: int) -> tuple[Path, Path]:
    """A random Llama base and a random LoRA adapter of it (all-linear, r 16)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(ROOT))
    from tests.support import micro_model_dir

    base = micro_model_dir(d / "base", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                           num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, head_dim=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(base))
    model.save_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                  init_lora_weights=False))
    peft_model.save_pretrained(d / "adapter")
    adapter_config = json.loads((d / "adapter" / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = str(base)
    (d / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_config))
    return base, d / "adapter"


def measure(body: str, *args: str) -> tuple[float, float, float]:
    """(MiB at the imports, peak MiB, seconds) of ``body`` in a fresh process."""
    code = MEASURE.format(imports=IMPORTS, body=body)
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, check=True)
    imported, peak, seconds = done.stdout.split()[-3:]
    return int(imported) / 1024, int(peak) / 1024, float(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=4096)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        d = Path(tmp)
        start = time.perf_counter()
        base, adapter = build(d, args.hidden, args.layers, args.intermediate)
        weights = sum(f.stat().st_size for f in base.glob("*.safetensors")) / 2**20
        print(f"random Llama: {weights:.0f} MiB of fp32 weights, LoRA r 16 on every linear layer "
              f"(built in {time.perf_counter() - start:.0f}s)")
        rows = []
        for name, body in (("finetune export (streamed)", STREAMED), ("whole model, then written", WHOLE)):
            out = d / f"{name.split()[0]}.gguf"
            imported, peak, seconds = measure(body, str(adapter), str(out), str(base))
            rows.append((name, peak - imported, seconds, out.stat().st_size / 2**20))
        print(f"{'':28s} {'peak above imports':>19s} {'seconds':>8s} {'file':>9s}")
        for name, extra, seconds, size in rows:
            print(f"{name:28s} {extra:15.0f} MiB {seconds:8.1f} {size:5.0f} MiB")
        print(f"ratio (streamed / whole): memory {rows[0][1] / rows[1][1]:.2f}, time {rows[0][2] / rows[1][2]:.2f}")


if __name__ == "__main__":
    main()
