"""Model FLOPs per training token (finetune.plan.flops) against torch's FLOP counter, and the MFU arithmetic."""

from __future__ import annotations

import pytest
import torch

from finetune.plan.flops import training_flops_per_token
from tests.support import TINY_MODEL

BATCH, SEQ = 2, 128


def counted_flops_per_token(model: torch.nn.Module) -> float:
    """One training micro-step (forward, loss, backward) counted by ``FlopCounterMode``, per token.

    Eager attention: the counter has no formula for CPU sdpa's fused kernel, while eager's score and value
    matmuls are plain ``matmul``s it counts (over the whole T x T square, as the formula does)."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(3, 250, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops() / (BATCH * SEQ)


def tiny(method: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).train()
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        )
    if method == "prompt":  # 32 virtual token positions before each row's 128, every input projection's gradient
        from finetune.model.methods import inject
        from finetune.spec import AdapterSpec

        model = inject(model, AdapterSpec(kind="prompt", num_virtual_tokens=32))
    return model


@pytest.mark.parametrize("method", ["full", "lora", "prompt"])
def test_flops_per_token_match_the_counted_step(method):
    model = tiny(method)
    formula = training_flops_per_token(model, seq_len=SEQ)
    counted = counted_flops_per_token(model)
    print(
        f"{method}: formula {formula.per_token:,.0f} counted {counted:,.0f} FLOPs/token "
        f"ratio {formula.per_token / counted:.4f}"
    )
    assert formula.per_token == pytest.approx(counted, rel=0.01)


def test_mfu_of_a_given_rate_on_named_gpus():
    """The formula and the datasheet lookup: an 8B model's 6N FLOPs per token at 8,000 tokens/s on an H100 in
    bf16 is 38.8% of its 989.4 TFLOPS dense peak; the same rate on 8 GPUs is an eighth of that."""
    from finetune.plan.flops import mfu

    flops = 6 * 8.0e9
    one = mfu(8000, flops, "h100", "bf16")
    assert one.mfu == pytest.approx(8000 * flops / 989.4e12)
    assert one.text() == "MFU: 38.8% of h100 bf16 peak (989.4 TFLOPS)"
    assert mfu(8000, flops, "H100", "bf16", gpus=8).mfu == pytest.approx(one.mfu / 8)
    assert mfu(200, flops, "a100", "fp32").text() == "MFU: 49.2% of a100 fp32 peak (19.5 TFLOPS)"
    assert mfu(8000, flops, "v100", "bf16") is None  # no bf16 on a V100
    assert mfu(8000, flops, "quadro-rtx8000", "bf16") is None
    assert mfu(8000, flops, None, "bf16") is None


@pytest.mark.parametrize(
    ("device_name", "gib", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 80, "h100"),
        ("NVIDIA H100 PCIe", 80, "h100-pcie"),
        ("NVIDIA H200", 141, "h200"),
        ("NVIDIA A100-SXM4-40GB", 40, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", 80, "a100"),
        ("NVIDIA L4", 24, "l4"),
        ("NVIDIA L40S", 48, "l40s"),
        ("NVIDIA A10G", 24, "a10g"),
        ("NVIDIA RTX A6000", 48, "a6000"),
        ("NVIDIA GeForce RTX 4090", 24, "rtx4090"),
        ("Tesla V100-SXM2-16GB", 16, "v100-16gb"),
        ("Tesla T4", 16, "t4"),
        ("Quadro RTX 8000", 48, None),
    ],
)
def test_the_running_gpu_is_recognised_from_its_device_name(device_name, gib, expected):
    from finetune.plan.hardware import GiB, gpu_type_of

    assert gpu_type_of(device_name, gib * GiB) == expected


def test_gpu_type_given_for_a_plan_is_the_hardware_gpu_type():
    from finetune.plan.hardware import detect_hardware

    assert detect_hardware(gpu_type="H100", gpus=1).gpu_type == "h100"
    assert detect_hardware(device="cpu").gpu_type is None


def test_the_summary_gains_one_mfu_line_on_a_gpu_and_none_on_cpu(tmp_path):
    """The same finished run summarised as on CPU and as on a GPU: the only difference is the throughput line."""
    from rich.console import Console

    from finetune.plan.flops import mfu
    from finetune.plan.types import Candidate
    from finetune.spec import Method, Precision, Strategy
    from finetune.train.metrics.console import Reporter
    from finetune.train.state import RunResult

    chosen = Candidate(
        method=Method("full"),
        strategy=Strategy("single"),
        precision=Precision("bf16"),
        micro_batch_size=1,
        grad_accum_steps=1,
        activation_checkpointing=False,
        nproc=1,
    )
    result = RunResult(
        steps=4,
        final_loss=1.5,
        eval=None,
        output_dir=tmp_path,
        seconds=2.0,
        tokens_per_s=8000.0,
        utilisation=mfu(8000, 6 * 8.0e9, "h100", "bf16"),
    )

    def printed(**kwargs) -> list[str]:
        reporter = Reporter(True)
        reporter.console = Console(record=True, width=300)
        reporter.summary(result, chosen, 0, **kwargs)
        return reporter.console.export_text().splitlines()

    cpu, gpu = printed(), printed(gpu=True)
    assert [line for line in gpu if line not in cpu] == [
        "throughput: 8,000 tokens/s (training steps after the first) | MFU: 38.8% of h100 bf16 peak (989.4 TFLOPS)"
    ]
    assert [line for line in gpu if line in cpu] == cpu
    assert not any("MFU" in line or "tokens/s" in line for line in cpu)


def test_the_config_alone_gives_the_built_models_flops():
    """What the planner can ask without a model (meta device) is what the trainer's built model gives."""
    from transformers import AutoConfig

    from finetune.plan.flops import config_flops_per_token
    from finetune.recipe.schema import LoraConfig
    from finetune.spec import adapter_spec

    config = AutoConfig.from_pretrained(TINY_MODEL)
    lora = adapter_spec("lora", LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]), None, None)
    assert config_flops_per_token(config, seq_len=SEQ) == training_flops_per_token(tiny("full"), seq_len=SEQ)
    assert config_flops_per_token(config, seq_len=SEQ, adapter=lora) == training_flops_per_token(
        tiny("lora"), seq_len=SEQ
    )
    from finetune.plan.flops import flops_shape
    from finetune.spec import AdapterSpec

    prompt = AdapterSpec(kind="prompt", num_virtual_tokens=32)
    built = training_flops_per_token(tiny("prompt"), seq_len=SEQ)
    assert config_flops_per_token(config, seq_len=SEQ, adapter=prompt) == built
    assert flops_shape(config, prompt).flops(SEQ).per_token == pytest.approx(built.per_token, rel=1e-12)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: MFU is measured against a GPU's peak"
)
def test_a_gpu_run_prints_and_logs_its_mfu(tmp_path, finetune_cmd):
    """Four bf16 steps of the tiny model on the GPU: the summary names the GPU and its bf16 peak, and every
    logged row carries an MFU between 0 and 1 (the tiny model is far from the peak, but not at zero)."""
    import json
    import re
    import subprocess

    from finetune.plan.hardware import PEAK_TFLOPS, gpu_type_of
    from tests.support import tiny_recipe, write_recipe

    out = tmp_path / "run"
    recipe = tiny_recipe(out, precision="bf16", eval={"at_start": False})
    recipe["data"].pop("eval")
    proc = subprocess.run(
        [*finetune_cmd, "run", str(write_recipe(tmp_path / "r.yaml", recipe))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    props = torch.cuda.get_device_properties(0)
    kind = gpu_type_of(props.name, props.total_memory)
    if kind is None:
        assert "MFU: n/a" in proc.stdout
        return
    line = re.search(r"MFU: (\d+\.\d)% of (\S+) bf16 peak \(([\d.]+) TFLOPS\)", proc.stdout)
    assert line is not None, proc.stdout
    assert line.group(2) == kind and float(line.group(3)) == PEAK_TFLOPS[kind]["bf16"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["mfu"] < 1 for r in rows if "loss" in r)
