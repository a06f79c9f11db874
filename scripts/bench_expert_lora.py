"""LoRA on a mixture's fused expert weights: peft's ``target_parameters`` (``lora.ParamWrapper``) against
finetune's experts layer (finetune/model/experts.py), side by side on the same model, adapters and batch.

    python scripts/bench_expert_lora.py [--experts 32] [--hidden 256] [--ffn 256] [--top-k 4] [--tokens 2048]
                                        [--batched-tokens 256] [--steps 5] [--threads 1] [--fsdp] [--nf4]

For each experts implementation (eager, grouped_mm, batched_mm) and each way: seconds per training step
(forward + backward of a 2-layer Qwen3-MoE, the fastest of ``--steps``, the two ways taking turns), the step's
peak tensor memory (torch's
MemTracker) and the largest difference of the logits from the other way's with the same adapter values.
batched_mm gathers a weight per token-expert pair (both ways: tokens x top-k copies of an expert's weight), so
it runs on ``--batched-tokens``.
``--fsdp``: both ways also under FSDP2 (``fully_shard`` per decoder layer) on 2 gloo processes, each rank's
losses against one process's. fp32 on CPU.
``--nf4``: NF4 storage of one fused expert weight (experts x ffn*2 x hidden, bf16), bitsandbytes' functional
``quantize_4bit`` per expert (what finetune stores) against torchao's ``NF4Tensor`` (installed apart: it takes
2-D tensors, so the (experts*rows) x cols view): bytes per weight, error, seconds to quantize and to dequantize
every expert, and whether one expert's rows can be dequantized alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WAYS = ("peft target_parameters", "finetune experts layer")
KERNELS = ("eager", "grouped_mm", "batched_mm")


def build(args: argparse.Namespace, way: str, kernel: str):
    """The 2-layer model with LoRA (r 8) on q_proj and both fused expert weights, the adapters seeded alike."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from finetune.model.experts import peft_as_targeted
    from finetune.model.methods import training_method
    from finetune.spec import AdapterSpec

    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=args.hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.hidden // 4, intermediate_size=args.ffn, moe_intermediate_size=args.ffn,
        num_experts=args.experts, num_experts_per_tok=args.top_k, tie_word_embeddings=False,
    )
    config._experts_implementation = kernel
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if way == WAYS[0]:
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"],
                          target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        with peft_as_targeted():
            model = get_peft_model(model, lora)
    else:
        spec = AdapterSpec(kind="lora", r=8, alpha=16.0, target_modules=("q_proj", "experts"))
        model = training_method("lora", spec).inject(model)
    return model


def seed_adapters(ours, theirs) -> None:
    """The same random adapter values in both models (finetune's layout converted to peft's)."""
    import torch

    from finetune.model.experts import peft_layout

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ours.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    state = {n: p.detach().clone() for n, p in ours.named_parameters() if p.requires_grad}
    rest, tensors, _ = peft_layout(state, ours)
    mine = {**rest, **{k.replace(".lora_A.weight", ".lora_A.default.weight").replace(
        ".lora_B.weight", ".lora_B.default.weight"): v for k, v in tensors.items()}}
    params = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, value in mine.items():
            params[name].copy_(value)


def step_seconds(models: list, ids, steps: int) -> list[float]:
    """The fastest of ``steps`` forward + backward passes of each model, the models taking turns step by step (a
    shared machine's load then falls on every model alike, and the fastest pass is the least disturbed)."""
    times: list[list[float]] = [[] for _ in models]
    for _ in range(steps):
        for i, model in enumerate(models):
            t = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            times[i].append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
    return [min(t) for t in times]


def peak_bytes(model, ids) -> int:
    """The peak tensor bytes of one forward + backward (MemTracker)."""
    from finetune.train.metrics.memory import mem_tracker_class

    tracker = mem_tracker_class()()
    tracker.track_external(model)
    with tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return _peak(tracker)


def _peak(tracker) -> int:
    snapshot = tracker.get_tracker_snapshot("peak")
    return int(max(v.get("Total", 0) for v in snapshot.values()))


def _fsdp_worker(rank: int, store: str, args: argparse.Namespace, way: str, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    losses: list[float] = []
    try:
        model = build(args, way, "grouped_mm")
        inner = model.get_base_model()
        for layer in inner.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            ids = torch.randint(0, 512, (4, 64), generator=g)
            loss = model(input_ids=ids[rank * 2 : rank * 2 + 2], labels=ids[rank * 2 : rank * 2 + 2]).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach()
            dist.all_reduce(t)
            losses.append(t.item() / 2)
        result = {"losses": losses}
    except Exception as exc:  # the finding this mode reports: does the way run under FSDP2 at all
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def fsdp_compare(args: argparse.Namespace) -> None:
    import json

    import torch
    import torch.multiprocessing as mp

    for way in WAYS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            mp.spawn(_fsdp_worker, args=(os.path.join(tmp, "store"), args, way, out), nprocs=2)
            got = json.loads(Path(out).read_text())
        if "error" in got:
            print(f"fsdp x2 | {way:<24} | fails: {got['error']}")
            continue
        model = build(args, way, "grouped_mm")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        g = torch.Generator().manual_seed(2)
        want = []
        for _ in range(3):
            ids = torch.randint(0, 512, (4, 64), generator=g)
            loss = (model(input_ids=ids[:2], labels=ids[:2]).loss + model(input_ids=ids[2:], labels=ids[2:]).loss) / 2
            loss.backward()
            opt.step()
            opt.zero_grad()
            want.append(loss.item())
        diff = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want, strict=True))
        print(f"fsdp x2 | {way:<24} | runs; losses within {diff:.1e} of one process")


def nf4_compare(args: argparse.Namespace) -> None:
    import bitsandbytes.functional as bnbf
    import torch

    w = torch.randn(args.experts, 2 * args.ffn, args.hidden, generator=torch.Generator().manual_seed(4)).bfloat16()
    n_exp, rows, cols = w.shape
    t = time.perf_counter()
    states = [bnbf.quantize_4bit(w[e].contiguous(), blocksize=64, compress_statistics=True, quant_type="nf4")
              for e in range(n_exp)]
    quantize = time.perf_counter() - t
    t = time.perf_counter()
    back = torch.stack([bnbf.dequantize_4bit(p, s) for p, s in states])
    dequantize = time.perf_counter() - t
    stored = sum(p.numel() + s.absmax.numel() + 4 * s.state2.absmax.numel() for p, s in states)
    t = time.perf_counter()
    bnbf.dequantize_4bit(*states[3])
    one = time.perf_counter() - t
    print(f"nf4 | bitsandbytes per expert | {stored / w.numel():.4f} B/weight | mean error "
          f"{(back.float() - w.float()).abs().mean():.4f} | quantize {quantize:.3f}s | dequantize all {dequantize:.3f}s "
          f"| one expert {one * 1e3:.1f}ms")
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        print("nf4 | torchao NF4Tensor        | not installed (pip install torchao)")
        return
    t = time.perf_counter()
    nf4 = to_nf4(w.reshape(n_exp * rows, cols), block_size=64, scaler_block_size=256)
    quantize = time.perf_counter() - t
    t = time.perf_counter()
    back = nf4.get_original_weight().reshape(n_exp, rows, cols)
    dequantize = time.perf_counter() - t
    stored = sum(x.numel() * x.element_size() for x in (nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor))
    try:
        nf4[3 * rows : 4 * rows].get_original_weight()
        alone = "one expert alone: yes"
    except NotImplementedError as exc:
        alone = f"one expert alone: no ({str(exc).splitlines()[0][:60]})"
    print(f"nf4 | torchao NF4Tensor        | {stored / w.numel():.4f} B/weight | mean error "
          f"{(back.float() - w.float()).abs().mean():.4f} | quantize {quantize:.3f}s | dequantize all {dequantize:.3f}s "
          f"| {alone}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--batched-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--nf4", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.nf4:
        nf4_compare(args)
        return
    ids = torch.randint(0, 512, (args.tokens // 256, 256), generator=torch.Generator().manual_seed(3))
    print(f"Qwen3-MoE, 2 layers, hidden {args.hidden}, {args.experts} experts of ffn {args.ffn}, top-{args.top_k}, "
          f"{ids.numel()} tokens, LoRA r 8 on q_proj + both expert weights, fp32, {args.threads} thread(s)")
    print(f"{'kernel':<11} | {'way':<24} | {'s/step':>7} | {'peak MiB':>8} | logits vs the other way")  # s: fastest
    every = ids
    for kernel in KERNELS:
        ids = every[: max(1, args.batched_tokens // 256)] if kernel == "batched_mm" else every
        ours, theirs = build(args, WAYS[1], kernel), build(args, WAYS[0], kernel)
        seed_adapters(ours, theirs)
        with torch.no_grad():
            diff = (ours(input_ids=ids[:1]).logits - theirs(input_ids=ids[:1]).logits).abs().max().item()
        seconds = step_seconds([theirs, ours], ids, args.steps)
        rows = {WAYS[0]: (seconds[0], peak_bytes(theirs, ids)), WAYS[1]: (seconds[1], peak_bytes(ours, ids))}
        for way in WAYS:
            s, peak = rows[way]
            print(f"{kernel:<11} | {way:<24} | {s:7.3f} | {peak / 2**20:8.1f} | {diff:.1e}")
        (s0, p0), (s1, p1) = rows[WAYS[0]], rows[WAYS[1]]
        print(f"{kernel:<11} | finetune / peft          | {s1 / s0:7.2f} | {p1 / p0:8.2f} | ({ids.numel()} tokens)")
    if args.fsdp:
        fsdp_compare(args)


if __name__ == "__main__":
    main()
