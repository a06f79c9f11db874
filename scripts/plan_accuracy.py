"""How right is the planner? Real training steps on CPU, predicted vs measured peak memory.

Each configuration runs ``finetune run RECIPE --measure-memory`` (the real trainer, 1 or 2 processes on
gloo) for one optimizer step; the trainer's probe measures the peak of tensor memory with MemTracker and
writes memory.json. The prediction is the planner's for the same recipe and processes (for the first
optimizer step, which is what the probe measures: AdamW's state does not exist during its backward).

    python scripts/plan_accuracy.py            # all configurations, a table, median and worst error
    python scripts/plan_accuracy.py --fast     # the subset the test suite runs
    python scripts/plan_accuracy.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "models" / "tiny-llama"
SEQ_LEN = 128

# Small models of other architectures, with the tiny model's byte-level tokenizer (vocab 264).
ARCHS = {
    "qwen2": {"model_type": "qwen2", "vocab_size": 264, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False},
    "gpt2": {"model_type": "gpt2", "vocab_size": 264, "n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 512},
    # ~0.7B parameters for the GPU check (scripts/gpu_check.sh)
    "llama-0.7b": {"model_type": "llama", "vocab_size": 264, "hidden_size": 2048, "intermediate_size": 5504,
                   "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
                   "max_position_embeddings": 4096},
    # 26.4M parameters (scripts/fsdp_accumulation.py's model): FSDP2 under gradient accumulation
    "llama-26m": {"model_type": "llama", "vocab_size": 264, "hidden_size": 512, "intermediate_size": 1376,
                  "num_hidden_layers": 9, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                  "max_position_embeddings": 512, "tie_word_embeddings": False},
    # a large vocabulary: the loss runs in two chunks (finetune.objectives.loss.LOSS_CHUNK_BYTES)
    "llama-64k": {"model_type": "llama", "vocab_size": 65536, "hidden_size": 128, "intermediate_size": 344,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    "gemma2": {"model_type": "gemma2", "vocab_size": 264, "hidden_size": 256, "intermediate_size": 688,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
    # current architectures: a dense Qwen3 and a Qwen3 mixture of experts (fused experts, 16 of them, top-4;
    # the experts hold ~83% of the weights), the same attention
    "qwen3": {"model_type": "qwen3", "vocab_size": 264, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "tie_word_embeddings": False},
    "qwen3_moe": {"model_type": "qwen3_moe", "vocab_size": 264, "hidden_size": 256, "intermediate_size": 688,
                  "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
                  "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                  "tie_word_embeddings": False, "router_aux_loss_coef": 0.001},
}

# name, architecture, recipe changes, processes. Rows are exactly max_seq_len tokens with two documents
# each (see packed_samples), so the prediction's worst case is what runs.
CONFIGS: list[tuple[str, str, dict, int]] = [
    ("llama full fp32 mb16", "llama", {"method": "full", "precision": "fp32", "mbs": 16}, 1),
    ("qwen3 full fp32 mb16", "qwen3", {"method": "full", "precision": "fp32", "mbs": 16}, 1),
    ("qwen3 lora bf16 mb16", "qwen3", {"method": "lora", "precision": "bf16", "mbs": 16}, 1),
    # a mixture of experts: grouped_mm's routed tokens, the router's logits and its load-balancing loss
    ("qwen3_moe full fp32 mb16", "qwen3_moe", {"method": "full", "precision": "fp32", "mbs": 16}, 1),
    ("qwen3_moe full bf16 mb16", "qwen3_moe", {"method": "full", "precision": "bf16", "mbs": 16}, 1),
    ("qwen3_moe lora bf16 mb16", "qwen3_moe", {"method": "lora", "precision": "bf16", "mbs": 16}, 1),
    ("qwen3_moe qlora bf16 mb16", "qwen3_moe", {"method": "qlora", "precision": "bf16", "mbs": 16}, 1),
    ("qwen3_moe full fp32 fsdp x2", "qwen3_moe",
     {"method": "full", "precision": "fp32", "mbs": 8, "strategy": "fsdp"}, 2),
    ("llama full fp32 mb1 accum16", "llama", {"method": "full", "precision": "fp32", "mbs": 1}, 1),
    ("llama full bf16 mb16 ckpt", "llama", {"method": "full", "precision": "bf16", "mbs": 16, "ac": True}, 1),
    ("llama lora fp32 mb16", "llama", {"method": "lora", "precision": "fp32", "mbs": 16}, 1),
    ("llama qlora bf16 mb16", "llama", {"method": "qlora", "precision": "bf16", "mbs": 16}, 1),
    ("qwen2 full fp32 mb16", "qwen2", {"method": "full", "precision": "fp32", "mbs": 16}, 1),
    # GPT-2: Conv1D projections, tied head
    ("gpt2 full fp32 mb16", "gpt2", {"method": "full", "precision": "fp32", "mbs": 16}, 1),
    ("gpt2 full bf16 mb16", "gpt2", {"method": "full", "precision": "bf16", "mbs": 16}, 1),
    ("gpt2 lora bf16 mb16", "gpt2", {"method": "lora", "precision": "bf16", "mbs": 16, "targets": ["c_attn"]}, 1),
    ("llama-64k vocab lora bf16 mb8", "llama-64k",
     {"method": "lora", "precision": "bf16", "mbs": 8, "seq": 256}, 1),
    ("gemma2 full bf16 mb8 eager", "gemma2", {"method": "full", "precision": "bf16", "mbs": 8, "attn": "eager"}, 1),
    ("llama prefix fp32 mb16", "llama", {"method": "prefix", "precision": "fp32", "mbs": 16, "packing": False}, 1),
    ("llama adapter fp32 mb16", "llama", {"method": "adapter", "precision": "fp32", "mbs": 16}, 1),
    # prompt tuning: 16 virtual tokens before every row, 144 positions per row in every layer
    ("llama prompt fp32 mb16", "llama", {"method": "prompt", "precision": "fp32", "mbs": 16, "packing": False}, 1),
    ("llama dora fp32 mb16", "llama", {"method": "lora", "precision": "fp32", "mbs": 16, "dora": True}, 1),
    ("llama qlora 8-bit bf16 mb16", "llama", {"method": "qlora", "precision": "bf16", "mbs": 16, "bits": 8}, 1),
    ("llama full fp32 mb1 adamw8bit", "llama", {"method": "full", "precision": "fp32", "mbs": 1, "optimizer": "adamw8bit"}, 1),
    ("smollm2 lora bf16 mb4 packed", "smollm2", {"method": "lora", "precision": "bf16", "mbs": 4}, 1),
    # flex attention on CPU: finetune.model.flex's fallback keeps a (B, 1, T, T) mask per layer, which the plan traces
    ("llama full fp32 mb4 flex 512", "llama",
     {"method": "full", "precision": "fp32", "mbs": 4, "seq": 512, "attn": "flex_attention"}, 1),
    ("llama full fp32 ddp x2", "llama", {"method": "full", "precision": "fp32", "mbs": 8, "strategy": "ddp"}, 2),
    # DDP's gradients are views into its buckets; under accumulation no_sync's gradients are a second copy
    ("llama full fp32 ddp x2 accum2", "llama", {"method": "full", "precision": "fp32", "mbs": 4, "strategy": "ddp"}, 2),
    ("llama full fp32 ddp x2 seq32", "llama",
     {"method": "full", "precision": "fp32", "mbs": 8, "seq": 32, "strategy": "ddp"}, 2),
    ("llama full fp32 zero1 x2", "llama", {"method": "full", "precision": "fp32", "mbs": 8, "strategy": "zero1"}, 2),
    ("llama full bf16 zero1 x2", "llama", {"method": "full", "precision": "bf16", "mbs": 8, "strategy": "zero1"}, 2),
    ("llama full fp32 zero2 x2", "llama", {"method": "full", "precision": "fp32", "mbs": 8, "strategy": "zero2"}, 2),
    ("llama full fp32 fsdp x2", "llama", {"method": "full", "precision": "fp32", "mbs": 8, "strategy": "fsdp"}, 2),
    ("llama full bf16 fsdp x2", "llama", {"method": "full", "precision": "bf16", "mbs": 8, "strategy": "fsdp"}, 2),
    # gradient accumulation 4 under FSDP2: each micro-batch's gradients reduce-scattered into the sharded ones
    # (ExecSpec.sync_every_micro_batch), no unit's unsharded gradient kept to the next micro-batch
    ("llama-26m full fp32 fsdp x2 accum4", "llama-26m",
     {"method": "full", "precision": "fp32", "mbs": 2, "strategy": "fsdp"}, 2),
    ("llama-26m full fp32 zero2 x2 accum4", "llama-26m",
     {"method": "full", "precision": "fp32", "mbs": 2, "strategy": "zero2"}, 2),
    # pipeline stages under FSDP: torch's schedule turns FSDP2's sync and resharding after backward off until the
    # last micro-batch (every unit gathered, every gradient unsharded); pp 2 x dp 2 on 4 processes
    ("llama-26m full fp32 pp2 fsdp x2 accum4", "llama-26m",
     {"method": "full", "precision": "fp32", "mbs": 2, "strategy": "fsdp", "pp": 2, "packing": False}, 4),
    # train.offload (FSDP2's CPU offload; on CPU the host is the device) and 8-bit AdamW on the shards; two steps,
    # so that the optimizer state exists during the measured forward and backward (the steady-state prediction)
    ("llama full fp32 zero2 x2 offload optimizer", "llama",
     {"method": "full", "precision": "fp32", "mbs": 8, "strategy": "zero2", "offload": "optimizer", "steps": 2}, 2),
    ("llama full fp32 fsdp x2 offload parameters", "llama",
     {"method": "full", "precision": "fp32", "mbs": 8, "strategy": "fsdp", "offload": "parameters", "steps": 2}, 2),
    ("llama full fp32 zero2 x2 offload adamw8bit", "llama",
     {"method": "full", "precision": "fp32", "mbs": 8, "strategy": "zero2", "offload": "optimizer",
      "optimizer": "adamw8bit", "steps": 2}, 2),
    ("llama full fp32 fsdp x2 adamw8bit", "llama",
     {"method": "full", "precision": "fp32", "mbs": 8, "strategy": "fsdp", "optimizer": "adamw8bit", "steps": 2}, 2),
    # tensor parallelism: one replica split over 2 processes (each holds heads/2, kv_heads/2, intermediate/2)
    ("llama full fp32 tp2", "llama", {"method": "full", "precision": "fp32", "mbs": 16, "strategy": "ddp", "tp": 2}, 2),
    ("llama full bf16 tp2", "llama", {"method": "full", "precision": "bf16", "mbs": 16, "strategy": "ddp", "tp": 2}, 2),
    ("llama lora fp32 tp2", "llama", {"method": "lora", "precision": "fp32", "mbs": 16, "strategy": "ddp", "tp": 2}, 2),
    ("llama lora bf16 tp2", "llama", {"method": "lora", "precision": "bf16", "mbs": 16, "strategy": "ddp", "tp": 2}, 2),
    # the tp2 rows above run with sequence parallelism (distributed.sequence_parallel, on by default); without it
    # every rank holds the whole residual stream, norms and head rows
    ("llama full fp32 tp2 no sp", "llama",
     {"method": "full", "precision": "fp32", "mbs": 16, "strategy": "ddp", "tp": 2, "sp": False}, 2),
    ("llama lora fp32 tp2 no sp", "llama",
     {"method": "lora", "precision": "fp32", "mbs": 16, "strategy": "ddp", "tp": 2, "sp": False}, 2),
    # dpo (train.objective: dpo): chosen and rejected rows of exactly max_seq_len tokens per pair; the reference is
    # LoRA's base (adapters off), a frozen copy (full, reference: model) or precomputed before the first step
    ("llama lora fp32 mb8 dpo", "llama", {"method": "lora", "precision": "fp32", "mbs": 8, "objective": "dpo"}, 1),
    ("llama full fp32 mb8 dpo reference model", "llama",
     {"method": "full", "precision": "fp32", "mbs": 8, "objective": "dpo"}, 1),
    ("llama full fp32 mb8 dpo precomputed", "llama",
     {"method": "full", "precision": "fp32", "mbs": 8, "objective": "dpo", "reference": "precomputed"}, 1),
    # pipeline parallelism: 2 stages of 2 layers on 2 processes (unpacked rows: stages take whole rows), 4
    # micro-batches; every stage's peak against its rank's (the worst stage is the error)
    ("llama full fp32 pp2 1f1b", "llama",
     {"method": "full", "precision": "fp32", "mbs": 4, "strategy": "ddp", "pp": 2, "packing": False}, 2),
    ("llama full fp32 pp2 gpipe", "llama",
     {"method": "full", "precision": "fp32", "mbs": 4, "strategy": "ddp", "pp": 2, "pp_schedule": "gpipe",
      "packing": False}, 2),
    # with activation checkpointing a held micro-batch keeps little beside the stage's gradients
    ("llama full fp32 pp2 gpipe ckpt", "llama",
     {"method": "full", "precision": "fp32", "mbs": 4, "strategy": "ddp", "pp": 2, "pp_schedule": "gpipe",
      "packing": False, "ac": True}, 2),
]
FAST = ["llama full fp32 mb16", "llama lora fp32 mb16"]
# On a CUDA GPU (scripts/gpu_check.sh): torch.cuda.max_memory_allocated against the plan.
GPU_CONFIGS: list[tuple[str, str, dict, int]] = [
    ("0.7b full bf16 mb4", "llama-0.7b", {"method": "full", "precision": "bf16", "mbs": 4, "seq": 1024}, 1),
    ("0.7b lora bf16 mb4", "llama-0.7b", {"method": "lora", "precision": "bf16", "mbs": 4, "seq": 1024}, 1),
    ("0.7b qlora bf16 mb4", "llama-0.7b", {"method": "qlora", "precision": "bf16", "mbs": 4, "seq": 1024}, 1),
    ("0.7b full bf16 mb4 ckpt", "llama-0.7b",
     {"method": "full", "precision": "bf16", "mbs": 4, "seq": 1024, "ac": True}, 1),
    ("0.7b lora fp16 mb4", "llama-0.7b", {"method": "lora", "precision": "fp16", "mbs": 4, "seq": 1024}, 1),
    # packed rows with flex attention's BlockMask instead of sdpa's (B, 1, T, T) mask (CPU has no flex backward)
    ("0.7b lora bf16 mb4 flex", "llama-0.7b",
     {"method": "lora", "precision": "bf16", "mbs": 4, "seq": 1024, "attn": "flex_attention"}, 1),
]


def packed_samples(root: Path, seq_len: int = SEQ_LEN) -> Path:
    """Pre-tokenized rows of exactly seq_len / 2 tokens: packing puts two documents in every row, so rows
    are exactly seq_len wide and carry a document boundary (the masked attention path the planner plans for)."""
    import random

    path = root / f"half_rows_{seq_len}.jsonl"
    if not path.exists():
        rng = random.Random(0)
        with path.open("w") as f:
            for _ in range(256):
                f.write(json.dumps({"input_ids": [rng.randrange(3, 256) for _ in range(seq_len // 2)]}) + "\n")
    return path


def preference_pairs(root: Path, seq_len: int = SEQ_LEN) -> Path:
    """Preference rows whose chosen and rejected rows are both exactly ``seq_len`` tokens with the tiny byte
    tokenizer (BOS + prompt + completion + EOS): the planned worst case."""
    import random

    path = root / f"pairs_{seq_len}.jsonl"
    if not path.exists():
        rng = random.Random(0)
        half = seq_len // 2 - 1

        def text(n: int) -> str:
            return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))

        with path.open("w") as f:
            for _ in range(64):
                f.write(json.dumps({"prompt": text(half), "chosen": text(half), "rejected": text(half)}) + "\n")
    return path


def model_dir(arch: str, root: Path) -> Path:
    """A model directory (config + the tiny tokenizer) for ``arch``; random weights come from the seed."""
    if arch == "llama":
        return TINY
    if arch == "smollm2":  # the real pretrained model's directory (python scripts/get_smollm2.py)
        sys.path.insert(0, str(ROOT / "scripts"))
        from get_smollm2 import default_dest

        return default_dest()
    from transformers import AutoConfig

    d = root / arch
    if not d.exists():
        d.mkdir(parents=True)
        facts = dict(ARCHS[arch])
        AutoConfig.for_model(facts.pop("model_type"), **facts).save_pretrained(d)
        for f in TINY.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, d / f.name)
    return d


def recipe_for(arch: str, change: dict, nproc: int, root: Path, out: Path, steps: int = 1) -> dict:
    """The recipe of one configuration."""
    mbs = change["mbs"]
    seq = change.get("seq", SEQ_LEN)
    packing = change.get("packing", True)
    # without packing (prefix and prompt tuning refuse it), rows of exactly seq tokens: the planned worst case
    rows = packed_samples(root, seq) if packing else packed_samples(root, 2 * seq)
    data = {"train": str(rows), "format": "tokenized", "max_seq_len": seq, "packing": packing}
    if "objective" in change:
        data = {"train": str(preference_pairs(root, seq)), "format": "preference", "max_seq_len": seq}
    return {
        "model": {"path": str(model_dir(arch, root)), "init": "random", "attn_implementation": change.get("attn", "sdpa")},
        "method": change["method"],
        "lora": {"r": 8, "alpha": 16, "target_modules": change.get("targets", ["q_proj", "v_proj"]),
                 "use_dora": change.get("dora", False)},
        "prefix": {"num_virtual_tokens": 16},
        "prompt": {"num_virtual_tokens": 16},
        "adapter": {"reduction_factor": 8},
        "quantization": {"bits": change.get("bits", 4)},
        "data": data,
        "train": {"max_steps": steps, "global_batch_size": 16, "micro_batch_size": mbs,
                  "activation_checkpointing": change.get("ac", False), "lr": 1e-3, "seed": 0,
                  "optimizer": change.get("optimizer", "adamw"), "offload": change.get("offload", "none"),
                  "objective": change.get("objective", "sft")},
        "dpo": {"reference": change.get("reference", "model")},
        "precision": change["precision"],
        "distributed": {"strategy": change.get("strategy", "single"), "nproc": nproc, "tp": change.get("tp", 1),
                        "pp": change.get("pp", 1), "pp_schedule": change.get("pp_schedule", "1f1b"),
                        "sequence_parallel": change.get("sp", True)},
        "eval": {"every": 0},
        "output": {"dir": str(out), "log_every": 1},
    }


def run_one(name: str, arch: str, change: dict, nproc: int, root: Path, device: str = "cpu", steps: int = 1) -> dict:
    """Train ``steps`` steps through the real CLI; return predicted, measured and the error (and tokens/s
    after two warm-up steps when there are more)."""
    from finetune.plan.flowchart import chosen_memory, chosen_stage_memory
    from finetune.plan.types import Plan
    from finetune.recipe.schema import load_recipe

    out = root / name.replace(" ", "_")
    steps = change.get("steps", steps)  # a configuration may need more steps than the others
    path = root / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe_for(arch, change, nproc, root, out, steps), sort_keys=False))
    cmd = [sys.executable, "-m", "finetune", "run", str(path), "--nproc", str(nproc)]
    if device == "cpu":
        cmd.append("--measure-memory")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    mem_file = out / "memory.json"
    if proc.returncode != 0 or not mem_file.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        return {"config": name, "error": f"run failed ({proc.returncode}): {' | '.join(tail)}"}
    measured = json.loads(mem_file.read_text())
    plan = Plan.from_dict(json.loads((out / "plan.json").read_text()))
    first = chosen_memory(load_recipe(path), plan, device=device, first_step=True)
    steady = plan.chosen.memory.total
    meas = int(measured["measured_peak"])
    # One step: AdamW's state never exists, the first-step prediction applies; more: the probe spans the
    # first two steps, the steady state's.
    pred = first.total - first.overhead if steps == 1 else steady - plan.chosen.memory.overhead
    stages = None
    if plan.chosen.pp > 1:  # each stage's prediction beside its rank's measurement (pp is the outermost dimension)
        predicted = chosen_stage_memory(load_recipe(path), plan, device=device, first_step=steps == 1)
        by_rank = {r["rank"]: int(r["measured_peak"]) for r in measured.get("ranks", [])}
        per = len(by_rank) // plan.chosen.pp or 1
        stages = [{"stage": i, "predicted": m.total - m.overhead, "measured": by_rank.get(i * per),
                   "error": (m.total - m.overhead - by_rank[i * per]) / by_rank[i * per] if by_rank.get(i * per) else None}
                  for i, m in enumerate(predicted)]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in rows if r.get("step", 0) > 2 and "tokens_per_s" in r]
    mfus = [r["mfu"] for r in rows if r.get("step", 0) > 2 and "mfu" in r]  # GPU runs only
    return {
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "mfu": statistics.median(mfus) if mfus else None,
        "config": name, "predicted": pred, "measured": meas, "error": (pred - meas) / meas, "ratio": pred / meas,
        "steady_state_prediction": steady, "by_category": measured.get("by_category", {}), "stages": stages,
        "chosen": {k: getattr(plan.chosen, k) for k in ("method", "strategy", "micro_batch_size", "grad_accum_steps")},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="only the configurations the test suite runs")
    ap.add_argument("--only", nargs="*", help="configuration names to run")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--gpu", action="store_true", help="the CUDA configurations (see scripts/gpu_check.sh)")
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps per run (> 2: tokens/s is printed)")
    args = ap.parse_args()
    device = "cuda" if args.gpu else "cpu"
    pool = GPU_CONFIGS if args.gpu else CONFIGS
    configs = [c for c in pool if (not args.fast or c[0] in FAST) and (not args.only or c[0] in args.only)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, arch, change, nproc in configs:
            r = run_one(name, arch, change, nproc, Path(tmp), device, args.steps)
            rows.append(r)
            if "predicted" in r:
                print(f"{name:32s} predicted {r['predicted'] / 2**20:8.2f} MiB  measured {r['measured'] / 2**20:8.2f} MiB"
                      f"  predicted/measured {r['ratio']:.3f}  error {100 * r['error']:+6.2f}%"
                      + (f"  {r['tokens_per_s']:,.0f} tokens/s" if r["tokens_per_s"] else "")
                      + (f"  MFU {100 * r['mfu']:.1f}%" if r["mfu"] else ""), flush=True)
                for st in r.get("stages") or []:
                    err = f"{100 * st['error']:+6.2f}%" if st["error"] is not None else "-"
                    print(f"{'':4s}stage {st['stage']}: predicted {st['predicted'] / 2**20:8.2f} MiB  measured "
                          f"{(st['measured'] or 0) / 2**20:8.2f} MiB  error {err}", flush=True)
            else:
                print(f"{name:32s} {r['error']}", flush=True)
    errs = [abs(r["error"]) for r in rows if "predicted" in r]
    if errs:
        print(f"\n{len(errs)} configurations: median |error| {100 * statistics.median(errs):.2f}%, "
              f"worst {100 * max(errs):.2f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if errs and len(errs) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
