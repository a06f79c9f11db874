"""What a training process sets up for a GPU before it touches one: CUDA's caching allocator with expandable
segments unless the user configured it (the launcher's environment, which torch.distributed.run's workers
inherit), and host-to-device copies of batches from pinned memory without waiting."""

from __future__ import annotations

import os

import pytest
import torch

from finetune.train.data import Example
from finetune.train.data.batches import collate, to_device, transfer_options
from finetune.train.runtime import allocator


def test_expandable_segments_unless_the_user_set_the_allocator() -> None:
    env: dict[str, str] = {}
    assert allocator.configure(env) == ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", True)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator.describe(env) == (
        "CUDA allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (finetune's default)"
    )
    for name in allocator.ALLOC_CONF_VARS:
        mine = {name: "max_split_size_mb:128"}
        assert allocator.configure(mine) == (name, "max_split_size_mb:128", False)
        assert mine == {name: "max_split_size_mb:128"}  # nothing added beside the user's
        assert allocator.describe(mine) == f"CUDA allocator: {name}=max_split_size_mb:128 (set by you)"


def test_the_launcher_sets_it_in_the_environment_its_workers_inherit(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """``finetune run`` configures the allocator before it plans (the planner may query the GPU) and before
    torch.distributed.run copies its environment into every worker."""
    from finetune.commands.run import launch
    from finetune.recipe.schema import RecipeError

    for name in allocator.ALLOC_CONF_VARS:
        monkeypatch.setenv(name, "")  # restored to what it was (unset) after the test
        monkeypatch.delenv(name)
    with pytest.raises(RecipeError, match=r"missing\.yaml"):  # stops at the recipe, the allocator set before
        launch(str(tmp_path / "missing.yaml"), [])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_batches_reach_a_gpu_pinned_and_without_waiting() -> None:
    assert transfer_options(torch.device("cuda", 0)) == (True, True)
    assert transfer_options("cuda") == (True, True)
    assert transfer_options(torch.device("cpu")) == (False, False)
    batch = collate([Example([5, 6, 7], [-100, 6, 7]), Example([8], [8])], pad_id=0)
    moved = {k: to_device(v, torch.device("cpu")) for k, v in batch.items()}
    for k, v in batch.items():
        assert torch.equal(moved[k], v) and moved[k].device.type == "cpu"


class _StandInGpu:
    """A torch function mode for a machine without a GPU: a tensor's ``pin_memory()`` returns a copy marked
    pinned, and ``.to(cuda, non_blocking=...)`` returns the tensor itself, each call recorded (what the copy to a
    GPU would be asked). Everything else runs as torch runs it."""

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode

        outer = self
        self.pinned: set[int] = set()
        self.copies: list[tuple[bool, bool]] = []  # (the source was pinned, non_blocking) of each copy

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                if func is torch.Tensor.pin_memory:
                    with torch._C.DisableTorchFunction():
                        copy = args[0].clone()
                    outer.pinned.add(id(copy))
                    return copy
                if func is torch.Tensor.to and torch.device(args[1] if len(args) > 1 else kwargs["device"]).type == "cuda":
                    outer.copies.append((id(args[0]) in outer.pinned, bool(kwargs.get("non_blocking"))))
                    return args[0]
                return func(*args, **kwargs)

        self.mode = Mode()


def test_the_trainers_micro_batch_reaches_a_gpu_pinned_and_without_waiting() -> None:
    """finetune.train.trainer's move of a micro-batch (what train_step does to each) with a CUDA device: every
    tensor the forward reads (the ids, the labels, the fused head's target rows, a packed batch's positions and
    documents) is pinned on the host and copied without waiting; an attention mask is not sent."""
    from finetune.train.trainer import _to_device

    packed = collate([Example([5, 6, 7, 8], [-100, 6, 7, 8], position_ids=[0, 1, 0, 1])], pad_id=0)
    plain = collate([Example([5, 6, 7], [-100, 6, 7]), Example([8], [8])], pad_id=0)
    for mb, extra in ((plain, {"target_rows"}), (packed, {"target_rows", "document_ids"})):
        keys = set(mb) - {"attention_mask"} | extra
        gpu = _StandInGpu()
        with gpu.mode:
            moved = _to_device(mb, torch.device("cuda", 0))
        assert set(moved) == keys, set(moved)
        assert gpu.copies == [(True, True)] * len(keys)
        for k in keys & set(mb):
            assert torch.equal(moved[k], mb[k])


@pytest.mark.slow  # a trainer built and stepped once in this process
def test_the_trainers_step_sends_every_batch_through_to_device(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real optimizer step of the trainer: every tensor of the micro-batches it accumulates over, and every
    tensor its model's forwards read, was made by finetune.train.data.batches.to_device (pinned, non-blocking on
    a GPU: above), for the trainer's device."""
    from finetune.plan.flowchart import plan_for_run
    from finetune.recipe.schema import load_recipe
    from finetune.train import trainer as trainer_module
    from finetune.train.parallel.distributed import DistContext
    from tests.support import tiny_recipe, write_recipe

    sent: dict[int, torch.device] = {}
    real = trainer_module.to_device

    def spy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = real(t, device)
        sent[id(out)] = torch.device(device)
        return out

    monkeypatch.setattr(trainer_module, "to_device", spy)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out", train={"max_steps": 1},
                                                           eval={"every": 0}))
    loaded = load_recipe(str(recipe))
    trainer = trainer_module.Trainer(loaded, plan_for_run(loaded, nproc=1, nnodes=1, device="cpu"),
                                     DistContext(0, 1, 0, torch.device("cpu")))
    trainer.setup()
    read: list[tuple[str, int]] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        read.extend((k, id(v)) for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        read.extend(("positional", id(v)) for v in args if isinstance(v, torch.Tensor))

    given: list[tuple[str, int]] = []  # every tensor of the micro-batches the step accumulates over
    accumulate = trainer_module.accumulate

    def accumulating(model: torch.nn.Module, micro: list[dict], *args: object, **kwargs: object) -> torch.Tensor:
        given.extend((k, id(v)) for mb in micro for k, v in mb.items())
        return accumulate(model, micro, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "accumulate", accumulating)
    trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train_step()
    micro_batches = trainer.plan.chosen.grad_accum_steps
    assert {k for k, _ in given} >= {"input_ids", "labels", "target_rows"}
    assert len([k for k, _ in given if k == "labels"]) == micro_batches
    assert len([k for k, _ in read if k == "input_ids"]) == micro_batches
    assert [k for k, i in given + read if i not in sent] == []
    assert set(sent.values()) == {torch.device("cpu")}
