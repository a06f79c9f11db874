"""AdamW against the 8-bit AdamW on FSDP2 shards, side by side: 2 processes on gloo fully_shard a Llama
(recipes/models/tiny-llama unless --model) and time ``optimizer.step()``, with the optimizer-state bytes each
rank holds and their ratio. Both optimizers come from finetune/train/optimizer.py: build_optimizer, as the trainer
builds them under ``distributed.strategy: fsdp``.

    python scripts/bench_optimizer_sharded.py [--steps 6] [--model DIR] [--json]

The step is timed between barriers (the slower rank counts), after one warm-up step that allocates the state.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer-state tensors (a tensor shared by several parameters counted once)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for s in opt.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if isinstance(v, DTensor) else v
                seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def measure(name: str, model_dir: str, steps: int) -> dict[str, Any]:
    """Seconds per optimizer step and this rank's state bytes for ``train.optimizer: name`` under FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.recipe.schema import TrainConfig
    from finetune.spec import Strategy
    from finetune.train.optimizer import build_optimizer

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = build_optimizer(model, TrainConfig(optimizer=name, lr=1e-3), Strategy.FSDP)
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
    times = []
    for _ in range(steps + 1):
        model(ids, labels=ids).loss.backward()
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        opt.zero_grad(set_to_none=True)
    numel = sum(p.numel() for p in model.parameters())
    return {"optimizer": name, "type": type(opt).__name__, "params": numel, "first_step_s": times[0],
            "s_per_step": sum(times[1:]) / steps, "state_bytes_rank0": state_bytes(opt)}


def _worker(rank: int, port: int, model_dir: str, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        rows = [measure(name, model_dir, steps) for name in ("adamw", "adamw8bit")]
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Print the table (or --json)."""
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default=str(ROOT / "recipes/models/tiny-llama"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(_worker, args=(port, args.model, args.steps, out), nprocs=2)
        rows = json.loads(Path(out).read_text())
    adamw = rows[0]
    for r in rows:
        r["time_ratio"] = r["s_per_step"] / adamw["s_per_step"]
        r["state_ratio"] = r["state_bytes_rank0"] / adamw["state_bytes_rank0"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"fsdp x2 (gloo), {rows[0]['params']:,} parameters, {args.steps} timed steps; state per rank (rank 0)")
    print(f"{'optimizer':<11} {'class':<22} {'first step':>11} {'s/step':>9} {'x adamw':>8} "
          f"{'state MiB':>10} {'x adamw':>8}")
    for r in rows:
        print(f"{r['optimizer']:<11} {r['type']:<22} {r['first_step_s']:>10.3f}s {r['s_per_step']:>8.4f}s "
              f"{r['time_ratio']:>8.2f} {r['state_bytes_rank0'] / 2**20:>10.3f} {r['state_ratio']:>8.3f}")


if __name__ == "__main__":
    main()
