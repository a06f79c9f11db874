"""The training step reads device values on the host once: no sync inside the micro-batch loop.

On a GPU every ``.item()``, ``.cpu()``, ``float()``, ``.tolist()``, ``bool()`` or ``.nonzero()`` of a device
tensor waits for the kernels queued before it, so the host stops running ahead (and FSDP's prefetch waits
with it). CPU tensors cannot tell a sync apart, so these tests count the calls themselves, made while the
micro-batches' forward and backward passes and the gradient clipping run, on a real run of the tiny model.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import finetune.train.trainer as trainer_mod
from finetune.plan.flowchart import plan_for_run
from finetune.recipe.schema import load_recipe
from finetune.train.trainer import Trainer
from tests.support import tiny_recipe, write_recipe

pytestmark = pytest.mark.slow  # a real model and step each

READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__int__", "__float__", "__bool__")


class SyncCounter:
    """Counts host reads of tensor values while ``on`` (each with the frame that made it)."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[str] = []

    @contextmanager
    def counting(self) -> Iterator[None]:
        previous, self.on = self.on, True
        try:
            yield
        finally:
            self.on = previous

    def wrap(self, name: str, original):
        counter = self

        def read(t, *args, **kwargs):
            if counter.on:
                counter.on = False  # a read inside a read (e.g. __bool__ calling item) counts once
                try:
                    frame = traceback.extract_stack(limit=3)[0]
                    counter.calls.append(f"{name} at {frame.filename}:{frame.lineno}")
                    return original(t, *args, **kwargs)
                finally:
                    counter.on = True
            return original(t, *args, **kwargs)

        return read


def _counting(monkeypatch: pytest.MonkeyPatch, counter: SyncCounter, *names: str) -> None:
    """Count host reads while the trainer's functions ``names`` run."""
    for name in names:
        fn = getattr(trainer_mod, name)

        def counted(*args, __fn=fn, **kwargs):
            with counter.counting():
                return __fn(*args, **kwargs)

        monkeypatch.setattr(trainer_mod, name, counted)


def _trainer(tmp_path: Path, **sections: dict) -> Trainer:
    recipe = tiny_recipe(tmp_path / "out", **sections)
    loaded = load_recipe(write_recipe(tmp_path / "r.yaml", recipe))
    trainer = Trainer(loaded, plan_for_run(loaded, nproc=1, nnodes=1, device="cpu"))
    trainer.setup()
    trainer.model.train()
    return trainer


@pytest.mark.parametrize("method,packing", [("full", False), ("lora", False), ("full", True)])
def test_micro_batch_loop_and_clipping_read_nothing_on_the_host(
    tmp_path: Path, monkeypatch, method: str, packing: bool
) -> None:
    """Four micro-batches of a step (forward, backward, accumulation) and the clipping make no host read,
    padded rows or packed ones; the step's figures are read once, together."""
    trainer = _trainer(
        tmp_path, method=method, train={"global_batch_size": 8, "micro_batch_size": 2, "max_grad_norm": 1.0},
        data={"packing": packing},
    )
    loop, figures = SyncCounter(), SyncCounter()
    for name in READS:
        original = getattr(torch.Tensor, name)
        # one wrapper per counter, stacked: each counts only while its own region runs
        monkeypatch.setattr(torch.Tensor, name, figures.wrap(name, loop.wrap(name, original)))
    _counting(monkeypatch, loop, "accumulate", "clip_grad_norm")
    _counting(monkeypatch, figures, "host_figures")
    result = trainer.train_step()
    assert loop.calls == []
    assert [c.split(" at ")[0] for c in figures.calls] == ["tolist"]
    assert result.loss > 0 and result.grad_norm > 0 and result.input_tokens > 0


def test_the_step_loss_is_the_host_loss(tmp_path: Path) -> None:
    """The figures read once equal what the step computed: the loss is the summed token loss over the
    counted target tokens, as the eval loss of the same batch computes it."""
    from finetune.objectives.loss import causal_lm_loss, count_target_tokens

    trainer = _trainer(tmp_path, train={"global_batch_size": 8, "micro_batch_size": 4})
    epoch, in_epoch = 0, 0
    micro = trainer.stream.micro_batches(epoch, in_epoch, rank=0, world_size=1, micro_batch_size=4)
    with torch.no_grad():
        total = sum(float(causal_lm_loss(trainer.model, mb)[0]) for mb in micro)
    tokens = sum(count_target_tokens(mb) for mb in micro)
    result = trainer.train_step()
    assert result.loss == pytest.approx(total / tokens, rel=1e-6)
