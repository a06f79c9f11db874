"""LoRA and QLoRA on a mixture's experts under FSDP2 on 2 gloo processes: the experts' 3-D adapters (and the
NF4 codes) sharded on dim 0 by expert train as one process does, and the saved adapter is the same."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from finetune.commands.run import LaunchOptions, launch
from tests.support import (
    LOSS_RTOL,
    arch_model_dir,
    finetune_run,
    max_rel,
    step_rows,
    tiny_recipe,
    write_recipe,
)

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """LoRA all-linear and QLoRA on a tiny Qwen3-MoE (8 experts: 4 per rank), 3 steps each, on one process
    (in this process) and under fsdp on 2."""
    tmp = tmp_path_factory.mktemp("experts-fsdp")
    model = arch_model_dir(tmp / "model", "qwen3_moe")
    out = {}
    for method in ("lora", "qlora"):
        for nproc in (1, 2):
            d = tmp / f"{method}-{nproc}"
            recipe = tiny_recipe(
                d, model={"path": str(model), "init": "random"}, method=method,
                lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}, data={"eval": None},
                train={"max_steps": 3, "lr": 1e-2},
                distributed={"strategy": "single" if nproc == 1 else "fsdp"},
            )
            path = write_recipe(tmp / f"{method}-{nproc}.yaml", recipe)
            if nproc == 1:
                assert launch(str(path), [], LaunchOptions(nproc=1)) == 0
            else:
                done = finetune_run(path, "--nproc", "2")
                assert done.returncode == 0, done.stderr[-3000:]
            out[(method, nproc)] = d
    return out


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_expert_adapters_under_fsdp_match_one_process(runs: dict, method: str) -> None:
    one, two = runs[(method, 1)], runs[(method, 2)]
    assert max_rel([r["loss"] for r in step_rows(two)], [r["loss"] for r in step_rows(one)]) <= LOSS_RTOL
    a, b = load_file(str(one / "adapter_model.safetensors")), load_file(str(two / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(".experts.base_layer.lora_A" in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=1e-3)
