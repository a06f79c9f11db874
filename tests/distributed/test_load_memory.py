"""Host memory of LoRA under fsdp on 2 processes with a checkpoint stored in fp32, against the same run of the
tiny model: each rank's peak RssAnon over the whole run exceeds the tiny run's by at most its half of the
model in bf16 plus three decoder layers (FSDP's gathered units) plus 64 MiB, not by the checkpoint; and the
plan's host memory per node is within 10% of the sum of the ranks' measured peaks, while loading and over the
whole run (finetune/plan/job.py; finetune/train/runtime/heap.py says where glibc's sliding mmap threshold puts the memory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import RECIPES, micro_model_dir, tiny_recipe, write_recipe

pytestmark = [pytest.mark.dist, pytest.mark.memory]

HOOKS = Path(__file__).resolve().parents[1] / "hostmem_hooks.py"
MiB = 2**20
#: ~39M parameters with tiny-llama's byte tokenizer: 150 MiB in fp32, 75 MiB in bf16, a decoder layer 12.4 MiB
#: in bf16 (the embeddings are 264 rows: the layers are the model).
MID = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 6,
    "num_hidden_layers": 6,
}


def save_seeded(d: Path, sizes: dict[str, int], dtype: str) -> dict[str, int]:
    """A pretrained-style model directory: tiny-llama's tokenizer and config with ``sizes``, weights drawn from
    seed 0 and saved in ``dtype`` (float32 or bfloat16). Returns its sizes in bytes: ``bf16`` (every parameter
    in bf16, as LoRA stores the frozen base), ``block`` (one decoder layer in bf16) and ``file`` (on disk)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    micro_model_dir(d, **sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.float32)
    model.to(getattr(torch, dtype)).save_pretrained(d)
    layer = model.get_submodule("model.layers.0")
    return {
        "bf16": 2 * sum(p.numel() for p in model.parameters()),
        "block": 2 * sum(p.numel() for p in layer.parameters()),
        "file": sum(f.stat().st_size for f in d.glob("*.safetensors")),
    }


def start_lora_run(
    tmp: Path, name: str, model_dir: Path, code: Path | None = None
) -> tuple[subprocess.Popen, Path, Path]:
    """`finetune run` of LoRA (bf16) under fsdp on 2 gloo processes, one step, with tests/hostmem_hooks.py;
    the process, its output directory and the hooks' directory. ``code``: another checkout of finetune to run
    (scripts/bench_load_memory.py --old-ref)."""
    out = tmp / f"{name}-run"  # apart from the model directory, which is tmp / name
    r = tiny_recipe(
        out,
        model={"path": str(model_dir), "init": "pretrained"},
        method="lora",
        precision="bf16",
        lora={"r": 8},
        data={"train": str(RECIPES / "data/reverse/train.jsonl"), "eval": None, "max_seq_len": 48},
        train={"max_steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-4},
        distributed={"strategy": "fsdp", "nproc": 2},
        output={"dir": str(out)},
    )
    probe = tmp / f"{name}-mem"
    env = {  # without allocator settings of the caller's: the launcher's own reach the workers
        **{k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
        "FINETUNE_HOOKS": f"{HOOKS}:HostMemoryHooks",
        "FINETUNE_HOSTMEM_DIR": str(probe),
        "OMP_NUM_THREADS": "1",
        **({"PYTHONPATH": str(code)} if code is not None else {}),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetune", "run", str(write_recipe(tmp / f"{name}.yaml", r))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=code,
    )
    return proc, out, probe


def finish_run(proc: subprocess.Popen, out: Path, probe: Path) -> tuple[dict[int, dict], dict[str, int]]:
    """Each rank's phases (hostmem_hooks) and the job figures of the plan the run saved."""
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    phases = {rank: json.loads((probe / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    return phases, json.loads((out / "plan.json").read_text())["job"]


def test_lora_fsdp_of_an_fp32_checkpoint_holds_its_shards_not_the_checkpoint(tmp_path: Path) -> None:
    sizes = save_seeded(tmp_path / "mid", MID, "float32")
    save_seeded(tmp_path / "tiny", {}, "float32")
    assert 140 * MiB < sizes["file"] < 160 * MiB
    # The two runs side by side: RssAnon is each process's own.
    runs = [start_lora_run(tmp_path, name, tmp_path / name) for name in ("mid", "tiny")]
    (mid, job), (tiny, _) = (finish_run(*run) for run in runs)
    bound = sizes["bf16"] // 2 + 3 * sizes["block"] + 64 * MiB
    for rank in (0, 1):  # the allocator setting the launcher gives its workers (finetune/train/runtime/allocator.py)
        assert mid[rank]["environment"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for rank in (0, 1):
        over = mid[rank]["run"]["peak"] - tiny[rank]["run"]["peak"]
        print(f"rank {rank}: peak RssAnon {mid[rank]['run']['peak'] / MiB:.0f} MiB, {over / MiB:.0f} over the tiny run")
        assert over <= bound, (rank, over / MiB, bound / MiB)
    for figure, phase in (("host_peak_per_node", "run"), ("host_loading_per_node", "load")):
        measured = sum(mid[rank][phase]["peak"] for rank in (0, 1))
        print(f"{figure}: plan {job[figure] / MiB:.0f} MiB, measured {measured / MiB:.0f} MiB")
        assert abs(job[figure] - measured) <= 0.10 * measured, (figure, job[figure] / MiB, measured / MiB)
