"""FSDP2 under gradient accumulation: reduce-scatter every micro-batch, or keep the unsharded gradients until the
last one. Memory against communication, side by side, from one run.

Two gloo processes train a Llama of 26M parameters (random weights, fp32, full fine-tuning) the way the trainer
does (``finetune.train.parallel.parallelize.parallelize`` from the execution spec, ``finetune.train.gradients.accumulate``,
clipping, fused AdamW, ``zero_grad(set_to_none=True)``), under fsdp and zero2, with accumulation 4, in both modes:

``last``   ``set_requires_gradient_sync(False)`` on the non-final micro-batches: every unit keeps its unsharded
           gradient (in the reduce dtype) from its first backward until the last micro-batch reduce-scatters it;
``every``  the reduce-scatter after every micro-batch (the trainer's: ``ExecSpec.sync_every_micro_batch``): the
           sharded gradients accumulate, no unit keeps an unsharded gradient past its backward.

Each rank measures its first step's peak of tensor memory with the trainer's probe (``PeakMemory``: MemTracker,
the figure ``--measure-memory`` reports), counts the bytes it sends in FSDP2's collectives (each all-gather and
reduce-scatter moves (n - 1) / n of its buffer over a ring) and times the steps after the first; the planner's
prediction for the same configuration stands beside the trainer's mode.

    python scripts/fsdp_accumulation.py                  # fsdp and zero2, accumulation 4
    python scripts/fsdp_accumulation.py --accum 1 4 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MiB = 2**20

# tiny-llama widened and deepened: 26.4M parameters, 100.6 MiB in fp32
MODEL = {"model_type": "llama", "vocab_size": 264, "hidden_size": 512, "intermediate_size": 1376,
         "num_hidden_layers": 9, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
         "max_position_embeddings": 512, "tie_word_embeddings": False}
MICRO_BATCH, SEQ_LEN = 2, 256
COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
               "all_reduce")


def _count_collectives(sent: dict[str, int]) -> None:
    """Wrap torch.distributed's collectives FSDP2 calls so that each adds the bytes this rank sends over a ring
    ((n - 1) / n of the gathered or scattered buffer; an all-reduce twice that) to ``sent`` by kind."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            n = dist.get_world_size(group)
            if _name == "all_reduce":
                t = args[0] if args else kwargs["tensor"]
                nbytes = 2 * t.numel() * t.element_size()
            else:  # (output, input): the larger one is the whole buffer
                out = args[0] if args else kwargs.get("output_tensor", kwargs.get("output"))
                inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
                nbytes = max(out.numel() * out.element_size(), inp.numel() * inp.element_size())
            kind = "all_reduce" if _name == "all_reduce" else _name.split("_")[0] + "_" + _name.split("_")[1]
            sent[kind] = sent.get(kind, 0) + int(nbytes * (n - 1) / n)
            return _fn(*args, **kwargs)

        setattr(dist, name, counted)


def _rank(rank: int, port: int, strategy: str, every: bool, accum: int, steps: int, out: str) -> None:
    """One rank of a 2-process run; rank 0 writes its figures to ``out``."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.spec import execution_spec
    from finetune.train.gradients import accumulate
    from finetune.train.metrics.memory import PeakMemory
    from finetune.train.optimizer import optimizer_class
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.parallelize import parallelize
    from finetune.train.runtime.preflight import RunPhase

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sent: dict[str, int] = {}
    _count_collectives(sent)
    facts = dict(MODEL)
    cfg = AutoConfig.for_model(facts.pop("model_type"), **facts)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    spec = execution_spec("full", strategy, "fp32", checkpointing=False, world_size=2)
    ctx = DistContext(rank, 2, rank, torch.device("cpu"))
    model = parallelize(model, spec, ctx)
    cls, options = optimizer_class("adamw")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = cls(params, lr=1e-4, **options)
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = float(2 * accum * MICRO_BATCH * (SEQ_LEN - 1))
    peaks, seconds, losses, per_step = [], [], [], []
    for step in range(steps):
        micro = []
        for _ in range(accum):
            x = torch.randint(3, 264, (MICRO_BATCH, SEQ_LEN), generator=gen)
            micro.append({"input_ids": x, "labels": x.clone()})
        probe = PeakMemory("cpu", modules=(model,), optimizer=opt)
        before = dict(sent)
        start = time.perf_counter()
        with probe if step == 0 else _nothing():
            loss = accumulate(model, micro, tokens, ctx, _nothing, None, RunPhase(), sync_every_micro_batch=every)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        per_step.append({k: v - before.get(k, 0) for k, v in sent.items()})
        peaks.append(probe.measured_peak_bytes)
        total = ctx.all_reduce_sum(loss)
        losses.append(float(total) / tokens)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "peak": peaks[0], "by_category": probe_categories(peaks, probe), "losses": losses,
            "sent_per_step": per_step[-1], "seconds": seconds,
        }))
    dist.barrier()
    dist.destroy_process_group()


def probe_categories(peaks: list[int], probe: Any) -> dict[str, int]:
    """The first step's breakdown (the probe measured that step only)."""
    return dict(probe.by_category) if peaks and probe.by_category else {}


class _nothing:
    """An empty context manager (the trainer's autocast off, and no probe after the first step)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(strategy: str, every: bool, accum: int, steps: int = 3) -> dict[str, Any]:
    """Rank 0's figures of one 2-process run."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "figures.json")
        mp.spawn(_rank, args=(_free_port(), strategy, every, accum, steps, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def predicted(strategy: str, accum: int) -> int:
    """The planner's first-step tensor bytes for the configuration (what the probe measures)."""
    from transformers import AutoConfig

    from finetune.plan.activations import TraceSpec, activation_profile
    from finetune.plan.memory import Setup, candidate_memory
    from finetune.plan.shapes import build_inventory
    from finetune.spec import execution_spec

    facts = dict(MODEL)
    cfg = AutoConfig.for_model(facts.pop("model_type"), **facts)
    spec = execution_spec("full", strategy, "fp32", checkpointing=False, world_size=2)
    inv = build_inventory(cfg, "fsdp_accumulation")
    profile = activation_profile(cfg, TraceSpec.of(spec, seq_len=SEQ_LEN, packed=False, attn_implementation="sdpa",
                                                   device="cpu"))
    mem, _ = candidate_memory(inv, profile, Setup(spec, MICRO_BATCH, accum, 2, "cpu"), first_step=True)
    return mem.total - mem.overhead


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", nargs="*", default=["fsdp", "zero2"])
    ap.add_argument("--accum", nargs="*", type=int, default=[4])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is measured)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    rows = []
    print(f"{'strategy':8s} {'accum':>5s} {'mode':6s} {'peak MiB':>9s} {'plan MiB':>9s} {'sent MiB/step':>14s}"
          f" {'s/step':>7s} {'loss':>8s}")
    for strategy in args.strategies:
        for accum in args.accum:
            pair = {}
            for every in (False, True):
                r = measure(strategy, every, accum, args.steps)
                r.update(strategy=strategy, accum=accum, mode="every" if every else "last")
                if every:
                    r["predicted"] = predicted(strategy, accum)
                pair[r["mode"]] = r
                rows.append(r)
                sent = sum(r["sent_per_step"].values())
                step_s = statistics.median(r["seconds"][1:]) if len(r["seconds"]) > 1 else r["seconds"][0]
                plan = f"{r['predicted'] / MiB:9.1f}" if "predicted" in r else f"{'':9s}"
                print(f"{strategy:8s} {accum:5d} {r['mode']:6s} {r['peak'] / MiB:9.1f} {plan} {sent / MiB:14.1f}"
                      f" {step_s:7.2f} {r['losses'][-1]:8.4f}", flush=True)
            last, every_ = pair["last"], pair["every"]
            sent_last, sent_every = sum(last["sent_per_step"].values()), sum(every_["sent_per_step"].values())
            print(f"{'':8s} {'':5s} every/last: peak {every_['peak'] / last['peak']:.3f}, sent "
                  f"{sent_every / sent_last:.3f}, plan/measured (every) {every_['predicted'] / every_['peak']:.3f}, "
                  f"loss difference {abs(every_['losses'][-1] - last['losses'][-1]):.2e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
