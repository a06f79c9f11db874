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
