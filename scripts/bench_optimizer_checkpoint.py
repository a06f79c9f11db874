"""The fp32 moments a checkpoint of the sharded 8-bit AdamW holds at once, exported whole against streamed.

One process, a group of one rank on gloo, a Llama-shaped stack of linears (``--layers`` x (hidden x hidden),
default 12 x 1024 x 1024: 4 MiB per fp32 moment) under FSDP2, and the trainer's 8-bit AdamW over its shards
(finetune/train/optimizer.py: LocalShardOptimizer) after one step. Each way saves the model and the optimizer
through the checkpointer's DCP path (finetune/train/checkpoint/checkpointer.py: save_sharded) and loads them back into a
fresh model and optimizer (load_sharded):

- ``exported``: the optimizer's plain ``state_dict()``, every moment dequantized first (what a checkpoint held
  before the checkpointer streamed them);
- ``streamed``: the checkpointer's own (``OptimizerState``): a placeholder per moment, dequantized when the
  writer reaches it and quantized back once the reader has filled it.

Printed for each: the peak bytes of bitsandbytes' dequantization outputs alive at once during the save (on a
GPU these are device memory: the moments before they reach host memory), the peak bytes of fp32 tensors made
during the load that are alive at once (the loading's destinations and the reader's copies), the seconds of
each, and the ratios. On CPU the device is the host, so this counts tensors, not a device's memory.

    python scripts/bench_optimizer_checkpoint.py [--layers 12] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch


class LiveBytes:
    """Bytes of the storages made by ``ops`` inside the mode that are alive at once, at most."""

    def __init__(self, ops: tuple[str, ...]) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                if str(func.overloadpacket) in ops:
                    for t in out if isinstance(out, (tuple, list)) else (out,):
                        if type(t) is torch.Tensor and t.dtype == torch.float32:
                            outer.born(t.untyped_storage())
                return out

        self.mode, self.now, self.peak, self.live = Mode(), 0, 0, set()

    def born(self, storage: Any) -> None:
        key, n = storage.data_ptr(), storage.nbytes()
        if key in self.live:
            return
        self.live.add(key)
        self.now += n
        self.peak = max(self.peak, self.now)

        def gone() -> None:
            self.live.discard(key)
            self.now -= n

        weakref.finalize(storage, gone)


def build(layers: int, hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The sharded stack and the trainer's 8-bit AdamW over it."""
    from torch.distributed.fsdp import fully_shard

    from finetune.recipe.schema import TrainConfig
    from finetune.spec import Strategy
    from finetune.train.optimizer import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, build_optimizer(model, TrainConfig(optimizer="adamw8bit", lr=1e-3), Strategy.FSDP)


class Exported:
    """The optimizer's plain state dict as the checkpoint's optimizer part: every moment dequantized first."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        from finetune.train.checkpoint.checkpointer import OptimizerState

        self.inner, self.opt = OptimizerState(model, opt), opt

    def state_dict(self) -> dict[str, Any]:
        self.opt.streamed = contextlib.nullcontext  # type: ignore[method-assign]
        try:
            return self.inner.state_dict()
        finally:
            del self.opt.streamed

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def measure(way: str, layers: int, hidden: int, root: Path) -> dict[str, float]:
    from finetune.train.checkpoint.checkpointer import ModelState, OptimizerState, load_sharded, save_sharded

    model, opt = build(layers, hidden)
    model(torch.randn(4, hidden)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    part = Exported if way == "exported" else OptimizerState
    saving = LiveBytes(("bitsandbytes.dequantize_blockwise",))
    started = time.perf_counter()
    with saving.mode:
        save_sharded({"model": ModelState(model, adapters_only=False), "optimizer": part(model, opt)},
                     root / way, 1)
    save_s = time.perf_counter() - started
    fresh, opt2 = build(layers, hidden)
    loading = LiveBytes(("aten.empty", "aten.clone", "aten._to_copy", "bitsandbytes.dequantize_blockwise"))
    started = time.perf_counter()
    with loading.mode:
        load_sharded({"model": ModelState(fresh, adapters_only=False), "optimizer": part(fresh, opt2)}, root / way, 1)
    load_s = time.perf_counter() - started
    same = all(
        torch.equal(opt.state[p]["state1"], opt2.state[q]["state1"])
        for p, q in zip(opt._params(), opt2._params(), strict=True)  # type: ignore[attr-defined]
    )
    return {"save_peak": saving.peak, "load_peak": loading.peak, "save_s": save_s, "load_s": load_s, "same": same}


def main() -> None:
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    MiB = 2**20
    try:
        with tempfile.TemporaryDirectory(prefix="bench-8bit-ckpt-") as tmp:
            got = {way: measure(way, args.layers, args.hidden, Path(tmp)) for way in ("exported", "streamed")}
    finally:
        dist.destroy_process_group()
    moment = args.hidden * args.hidden * 4
    print(f"{args.layers} x {args.hidden} x {args.hidden} under FSDP2, 8-bit AdamW: one fp32 moment {moment / MiB:.1f} MiB, "
          f"all {2 * args.layers * moment / MiB:.0f} MiB")
    print(f"{'way':<10}{'save: alive MiB':>17}{'load: alive MiB':>17}{'save s':>8}{'load s':>8}  codes restored")
    for way, g in got.items():
        print(f"{way:<10}{g['save_peak'] / MiB:>17.1f}{g['load_peak'] / MiB:>17.1f}{g['save_s']:>8.2f}{g['load_s']:>8.2f}"
              f"  {g['same']}")
    e, s = got["exported"], got["streamed"]
    print(f"exported / streamed: save {e['save_peak'] / s['save_peak']:.1f}x, load {e['load_peak'] / s['load_peak']:.1f}x "
          f"the bytes alive at once")


if __name__ == "__main__":
    main()
