"""finetune against TRL's SFTTrainer + peft: the same LoRA job, tokens per second, peak memory, final loss.

Each tool runs in its own process, one after the other, ``--repeats`` times (alternating), on the same
model (SmolLM2-135M-Instruct, `python scripts/get_smollm2.py`), LoRA config (r 8, alpha 16, q/k/v/o) and
initial adapters (finetune's per-name draw), batch, sequence length, precision, optimizer (AdamW, lr, cosine
schedule without warmup, clipping) and number of steps, and on the same data in the same order: TRL gets
finetune's tokenized samples (recipes/data/extract-json, chat, labels on the assistant turn only) in the order
of finetune's first epoch, read sequentially, so without packing both see the same batches and their losses
agree step by step. ``--packing``: both pack (finetune's best-fit rows, TRL's BFD padding-free rows); the
batches then differ, so only tokens/s and memory compare. Figures:

- tokens/s: real input tokens (padding excluded) of steps 2..N over their wall time (step 1 is warm-up);
- peak memory: the highest anonymous resident memory (RssAnon: the process's own heap, not the memory-
  mapped weight files) of the process, sampled every 20 ms by this script from outside, the same counter for
  both tools;
- final loss: the mean of the last 3 steps' token-mean training losses.

    python scripts/bench_peers.py [--steps 16] [--batch 8] [--repeats 2] [--packing] [--json]

Needs `pip install -e '.[bench]'` (trl). CPU, fp32 by default; on a GPU, --precision bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "recipes/data/extract-json/train.jsonl"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def job(args: argparse.Namespace) -> dict:
    """The one job both tools run."""
    return {
        "model": str(args.model),
        "data": str(DATA),
        "steps": args.steps,
        "batch": args.batch,
        "max_len": args.max_len,
        "lr": 1e-3,
        "warmup": 0,  # transformers' warmup starts at lr 0, finetune's at lr/warmup: none keeps them equal
        "precision": args.precision,
        "r": 8,
        "alpha": 16,
        "targets": TARGETS,
        "seed": 0,
        "packing": args.packing,
    }


# -- the children ----------------------------------------------------------------------------------------


def write_recipe(j: dict, out: Path) -> Path:
    """finetune's recipe for the job; the TRL child reads its samples through it too."""
    import yaml

    recipe = {
        "model": {"path": j["model"], "init": "pretrained"},
        "method": "lora",
        "lora": {"r": j["r"], "alpha": j["alpha"], "dropout": 0.0, "target_modules": j["targets"]},
        "data": {"train": j["data"], "format": "chat", "max_seq_len": j["max_len"], "packing": j["packing"]},
        "train": {
            "max_steps": j["steps"],
            "global_batch_size": j["batch"],
            "micro_batch_size": j["batch"],
            "lr": j["lr"],
            "lr_schedule": "cosine",
            "warmup_steps": j["warmup"],
            "max_grad_norm": 1.0,
            "seed": j["seed"],
            "activation_checkpointing": False,
        },
        "precision": j["precision"],
        "distributed": {"strategy": "single"},
        "eval": {"at_start": False},
        "output": {"dir": str(out / "run"), "log_every": 1},
    }
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_finetune(j: dict, out: Path) -> dict:
    """`finetune run` on a recipe equivalent to the job (through the real CLI, in this process)."""
    path = write_recipe(j, out)
    sys.argv = ["finetune", "run", str(path)]
    from finetune.cli import main

    try:
        main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    rows = [json.loads(x) for x in (out / "run/metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    # tokens_per_s is per logged window (one step here): a window's seconds are its tokens over its rate.
    tokens = [r["tokens"] - (rows[i - 1]["tokens"] if i else 0) for i, r in enumerate(rows)]
    seconds = [t / r["tokens_per_s"] for t, r in zip(tokens, rows, strict=True)]
    return {"losses": [r["loss"] for r in rows], "tokens": tokens, "seconds": seconds}


def finetune_samples(j: dict, out: Path) -> list[dict]:
    """The job's samples as finetune tokenizes them (ids, and labels -100 off the assistant turn), in the order
    finetune's first epoch visits them: given to TRL pre-tokenized and read in order, both tools train on the
    same tokens, the same loss tokens and (unpacked) the same batches."""
    from finetune.commands.run import prepare
    from finetune.train.data import BatchStream, load_data
    from finetune.train.model.build import load_tokenizer

    loaded = prepare(str(write_recipe({**j, "packing": False}, out)), [])
    tok = load_tokenizer(loaded)
    samples = load_data(loaded, tok).train
    order = BatchStream(samples, j["batch"], j["seed"], tok.pad_token_id).order(0)
    return [{"input_ids": samples[i].input_ids, "labels": samples[i].labels} for i in order]


def run_trl(j: dict, out: Path) -> dict:
    """TRL's SFTTrainer with a peft LoraConfig on finetune's tokenized samples (loss on the assistant turn
    only), in finetune's order (sequential sampler)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_list(finetune_samples(j, out))
    dtype = torch.float32 if j["precision"] == "fp32" else torch.bfloat16
    tok = AutoTokenizer.from_pretrained(j["model"])
    model = AutoModelForCausalLM.from_pretrained(
        j["model"], dtype=dtype
    )  # a frozen base, as finetune stores it
    config = SFTConfig(
        output_dir=str(out / "trl"),
        max_steps=j["steps"],
        per_device_train_batch_size=j["batch"],
        gradient_accumulation_steps=1,
        learning_rate=j["lr"],
        lr_scheduler_type="cosine",
        warmup_steps=j["warmup"],
        max_grad_norm=1.0,
        weight_decay=0.0,
        max_length=j["max_len"],
        packing=j["packing"],
        train_sampling_strategy="sequential",
        gradient_checkpointing=False,  # finetune's plan has it off for this job
        bf16=j["precision"] == "bf16",
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=j["seed"],
        dataloader_num_workers=0,
    )
    lora = LoraConfig(
        r=j["r"], lora_alpha=j["alpha"], lora_dropout=0.0, target_modules=j["targets"], task_type="CAUSAL_LM"
    )

    times: list[float] = []
    logged: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            times.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            times.append(time.perf_counter())

        def on_log(self, a, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                logged.append(dict(logs))

    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok, peft_config=lora)
    # The same initial adapters as finetune's (peft's distributions, drawn per parameter name; see
    # finetune.train.model.build.init_adapters): the two runs then start from the same weights.
    from finetune.train.model.build import init_adapters

    init_adapters(trainer.model, j["seed"])
    trainer.add_callback(Clock())
    trainer.train()
    seconds = [times[i + 1] - times[i] for i in range(0, len(times) - 1, 2)]
    cumulative = [int(x["num_tokens"]) for x in logged]  # real tokens (attention mask), cumulative
    tokens = [c - (cumulative[i - 1] if i else 0) for i, c in enumerate(cumulative)]
    return {"losses": [float(x["loss"]) for x in logged], "tokens": tokens, "seconds": seconds}


# -- the parent ------------------------------------------------------------------------------------------


def rss_anon(pid: int) -> int:
    """Anonymous resident bytes of ``pid`` and its descendants (0 once gone)."""
    total = 0
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def measure(tool: str, j: dict, workdir: Path) -> dict:
    """Run one tool's child process, sampling its memory; its figures."""
    out = workdir / f"{tool}-{time.time_ns()}"
    out.mkdir(parents=True)
    (out / "job.json").write_text(json.dumps(j))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, __file__, "--child", tool, "--workdir", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], rss_anon(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    log, _ = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        sys.exit(f"bench_peers: the {tool} run failed:\n{log[-4000:]}")
    res = json.loads((out / "result.json").read_text())
    steady = slice(1, None)  # step 1 is warm-up (first allocations, lazy initialisation)
    tokens, seconds = sum(res["tokens"][steady]), sum(res["seconds"][steady])
    losses = res["losses"]
    return {
        "tool": tool,
        "tokens_per_s": tokens / seconds,
        "peak_rss_anon": peak[0],
        "final_loss": sum(losses[-3:]) / len(losses[-3:]),
        "steps": len(losses),
        "tokens": sum(res["tokens"]),
        "losses": losses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--packing", action="store_true", help="both tools pack samples into max-len rows")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--model", type=Path, default=None, help="default: the get_smollm2.py directory")
    ap.add_argument("--tools", default="finetune,trl")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        j = json.loads((args.workdir / "job.json").read_text())
        res = (run_finetune if args.child == "finetune" else run_trl)(j, args.workdir)
        (args.workdir / "result.json").write_text(json.dumps(res))
        os._exit(0)  # the result is written; skip the interpreter's teardown
    if args.model is None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from get_smollm2 import DONE, default_dest

        args.model = default_dest()
        if not (args.model / DONE).is_file():
            sys.exit(f"bench_peers: no model at {args.model}; run `python scripts/get_smollm2.py` first")
    j = job(args)
    tools = args.tools.split(",")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        for rep in range(args.repeats):
            for tool in tools:
                r = measure(tool, j, Path(tmp))
                r["repeat"] = rep
                runs.append(r)
                if not args.json:
                    print(
                        f"  run {rep + 1} {tool:8s} {r['tokens_per_s']:8.1f} tokens/s  "
                        f"peak RssAnon {r['peak_rss_anon'] / 2**20:7.0f} MiB  final loss {r['final_loss']:.4f}",
                        flush=True,
                    )
    best = {}
    for tool in tools:
        mine = [r for r in runs if r["tool"] == tool]
        best[tool] = {
            "tokens_per_s": max(r["tokens_per_s"] for r in mine),
            "peak_rss_anon": min(r["peak_rss_anon"] for r in mine),
            "final_loss": mine[-1]["final_loss"],
        }
    summary = {"job": j, "runs": runs, "best": best}
    if len(tools) == 2:
        a, b = (best[t] for t in tools)
        summary["ratios"] = {
            "tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"],
            "peak_rss_anon": a["peak_rss_anon"] / b["peak_rss_anon"],
            "final_loss": a["final_loss"] / b["final_loss"],
        }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(
        f"\nSmolLM2-135M LoRA r8 q/k/v/o, {args.precision}, batch {args.batch} x <= {args.max_len} tokens "
        f"({'packed: each tool its own batches' if args.packing else 'padded: the same batches'}), "
        f"{args.steps} steps; best of {args.repeats} (tokens/s: highest, memory: lowest)"
    )
    print(f"{'':14s}{'tokens/s':>12s}{'peak RssAnon':>16s}{'final loss':>12s}")
    for tool in tools:
        b = best[tool]
        print(
            f"{tool:14s}{b['tokens_per_s']:12.1f}{b['peak_rss_anon'] / 2**20:12.0f} MiB{b['final_loss']:12.4f}"
        )
    if "ratios" in summary:
        r = summary["ratios"]
        print(
            f"{tools[0]}/{tools[1]:7s}{r['tokens_per_s']:11.2f}x{r['peak_rss_anon']:15.2f}x{r['final_loss']:11.3f}x"
        )


if __name__ == "__main__":
    main()
