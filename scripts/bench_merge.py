"""Benchmark `finetune merge` (streamed, shard by shard) against peft's merge_and_unload + save_pretrained.

    python scripts/bench_merge.py [--layers 6 --hidden 1024 --vocab 16000 --shard-size 100MB]

Builds a random Llama-like model (a few hundred MB in fp32) saved in several safetensors shards and a LoRA
adapter (rank 16 on every linear layer, non-zero B), then runs each merge in its own fresh subprocess and
reports its peak RSS (the child's own ``getrusage(RUSAGE_SELF).ru_maxrss``), the RSS after its imports (the
Python + torch + transformers + modeling-code floor both pay), the difference (what the merge itself
needed), wall time (imports excluded), and the ratios. Finally checks that both merged
checkpoints hold the same tensors.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_mib() -> float:
    """Peak RSS of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_make(work: Path, layers: int, hidden: int, vocab: int, shard_size: str) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75), num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(work / "base", max_shard_size=shard_size)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    peft_model.save_pretrained(work / "adapter")
    params = sum(p.numel() for p in model.parameters())
    return {"params": params}


def child_ours(work: Path) -> dict:
    import torch  # noqa: F401 - the same import floor as the peft run
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    from finetune.merge import merge

    floor = _rss_mib()
    start = time.perf_counter()
    merge(work / "adapter", work / "merged-ours", base=str(work / "base"), force=True)
    return {"seconds": time.perf_counter() - start, "floor_mib": floor}


def child_peft(work: Path, shard_size: str) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    floor = _rss_mib()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(model, work / "adapter").merge_and_unload()
    model.save_pretrained(work / "merged-peft", max_shard_size=shard_size)
    return {"seconds": time.perf_counter() - start, "floor_mib": floor}


def child_compare(work: Path) -> dict:
    import torch
    from safetensors import safe_open

    def tensors(d: Path) -> dict[str, Path]:
        index = d / "model.safetensors.index.json"
        if index.is_file():
            return {k: d / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return dict.fromkeys(f.keys(), d / "model.safetensors")

    ours, theirs = tensors(work / "merged-ours"), tensors(work / "merged-peft")
    worst = 0.0
    for k in sorted(set(ours) & set(theirs)):
        with safe_open(str(ours[k]), "pt") as a, safe_open(str(theirs[k]), "pt") as b:
            worst = max(worst, (a.get_tensor(k).float() - b.get_tensor(k).float()).abs().max().item())
    return {"same_keys": set(ours) == set(theirs), "max_abs_diff": worst, "tensors": len(ours), "_t": torch.__version__}


def run_child(args: list[str]) -> dict:
    """Run this script as a child doing one job; return its JSON line plus its own peak RSS."""
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"child {args[:2]} failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--shard-size", default="100MB")
    ap.add_argument("--workdir", type=Path, default=None, help="Keep the models here (default: a temp dir).")
    ap.add_argument("--child", choices=["make", "ours", "peft", "compare"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        work = a.workdir
        result = {
            "make": lambda: child_make(work, a.layers, a.hidden, a.vocab, a.shard_size),
            "ours": lambda: child_ours(work),
            "peft": lambda: child_peft(work, a.shard_size),
            "compare": lambda: child_compare(work),
        }[a.child]()
        result["peak_rss_mib"] = _rss_mib()
        print(json.dumps(result))
        return

    tmp = None
    if a.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-merge-")
        a.workdir = Path(tmp.name)
    work = a.workdir
    common = ["--workdir", str(work), "--layers", str(a.layers), "--hidden", str(a.hidden), "--vocab",
              str(a.vocab), "--shard-size", a.shard_size]
    made = run_child(["--child", "make", *common])
    shards = sorted((work / "base").glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    largest = max(p.stat().st_size for p in shards)
    adapter = (work / "adapter" / "adapter_model.safetensors").stat().st_size
    print(f"model: {made['params'] / 1e6:.0f}M params, {size / 2**20:.0f} MiB fp32 in {len(shards)} shards "
          f"(largest {largest / 2**20:.0f} MiB); adapter {adapter / 2**20:.1f} MiB")
    ours = run_child(["--child", "ours", *common])
    peft = run_child(["--child", "peft", *common])
    check = run_child(["--child", "compare", *common])
    print(f"{'':24s}{'peak RSS MiB':>14s}{'after imports':>15s}{'merge RSS':>11s}{'wall s':>9s}")
    for name, r in (("finetune merge", ours), ("peft merge_and_unload", peft)):
        print(f"{name:24s}{r['peak_rss_mib']:14.0f}{r['floor_mib']:15.0f}"
              f"{r['peak_rss_mib'] - r['floor_mib']:11.0f}{r['seconds']:9.1f}")
    print(f"ratios (finetune / peft): peak RSS {ours['peak_rss_mib'] / peft['peak_rss_mib']:.2f}, "
          f"RSS above imports {(ours['peak_rss_mib'] - ours['floor_mib']) / (peft['peak_rss_mib'] - peft['floor_mib']):.2f}, "
          f"wall time {ours['seconds'] / peft['seconds']:.2f}")
    print(f"outputs: same tensor names {check['same_keys']}, max |difference| {check['max_abs_diff']:.3g} "
          f"over {check['tensors']} tensors")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
