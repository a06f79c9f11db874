"""LoRA and QLoRA on a mixture's experts under FSDP2 on 2 gloo processes, for every mixture of experts of
tests/support.py (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3): the experts' 3-D adapters (and the NF4 codes) sharded
on dim 0 by expert train as one process does, and the saved adapter is the same."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from finetune.commands.run import LaunchOptions, launch
from tests.support import (
    LOSS_RTOL,
    MOE_ARCHITECTURES,
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
    """LoRA all-linear and QLoRA (all-linear, the experts in NF4) on each tiny mixture (2 to 4 experts per rank),
    3 steps each, on one process (in this process) and under fsdp on 2."""
    tmp = tmp_path_factory.mktemp("experts-fsdp")
    out = {}
    for arch in MOE_ARCHITECTURES:
        model = arch_model_dir(tmp / arch, arch)
        for method in ("lora", "qlora"):
            for nproc in (1, 2):
                d = tmp / f"{arch}-{method}-{nproc}"
                recipe = tiny_recipe(
                    d, model={"path": str(model), "init": "random"}, method=method,
                    lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}, data={"eval": None},
                    train={"max_steps": 3, "lr": 1e-2},
                    distributed={"strategy": "single" if nproc == 1 else "fsdp"},
                )
                path = write_recipe(tmp / f"{d.name}.yaml", recipe)
                if nproc == 1:
                    assert launch(str(path), [], LaunchOptions(nproc=1)) == 0
                else:
                    done = finetune_run(path, "--nproc", "2")
                    assert done.returncode == 0, done.stderr[-3000:]
                out[(arch, method, nproc)] = d
    return out


@pytest.mark.parametrize("method", ["lora", "qlora"])
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_expert_adapters_under_fsdp_match_one_process(runs: dict, arch: str, method: str) -> None:
    one, two = runs[(arch, method, 1)], runs[(arch, method, 2)]
    losses = [r["loss"] for r in step_rows(one)]
    assert len(losses) == 3 and losses[-1] != losses[0]
    assert max_rel([r["loss"] for r in step_rows(two)], losses) <= LOSS_RTOL
    a, b = load_file(str(one / "adapter_model.safetensors")), load_file(str(two / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(".experts.base_layer.lora_A" in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=1e-3)
