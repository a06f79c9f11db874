"""Every tiny model of a current architecture (tests/support.py: dense and mixtures of experts) plans and trains
under full fine-tuning (fp32 and bf16), LoRA and QLoRA on attention, and for the mixtures LoRA and QLoRA on every
linear layer and fused expert weight (``all-linear``: the experts' 3-D adapters, and under QLoRA their NF4 codes),
and the plan is within 3% (median) and 8% (worst) of the trainer's measured peak.

One module fixture trains every (architecture, method, precision) once, in-process through ``launch`` (the
planner's trace, then one optimizer step under ``--measure-memory``: MemTracker's peak over the step), and the
tests read its results. Rows are tokenized samples of half ``SEQ`` tokens, packed two to a row, so every row is
the planned worst case.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.support import ARCHITECTURES, MOE_ARCHITECTURES, arch_model_dir, write_jsonl, write_recipe

pytestmark = pytest.mark.slow

SEQ, MBS = 64, 4
#: (architecture, method, precision); a method ending in ``-all`` is LoRA or QLoRA with ``all-linear`` targets
CASES = [(arch, method, precision) for arch in ARCHITECTURES
         for method, precision in (("full", "fp32"), ("full", "bf16"), ("lora", "bf16"), ("qlora", "bf16"))] + [
    (arch, method, "bf16") for arch in MOE_ARCHITECTURES for method in ("lora-all", "qlora-all")]
#: LoRA on attention (DeepSeek-V3's multi-head latent attention has no q_proj/v_proj)
TARGETS = {"deepseek_v3": ["q_b_proj", "kv_b_proj"]}


def recipe(model_dir: Path, rows: Path, out: Path, method: str, precision: str, arch: str) -> dict:
    targets = "all-linear" if method.endswith("-all") else TARGETS.get(arch, ["q_proj", "v_proj"])
    return {
        "model": {"path": str(model_dir), "init": "random"},
        "method": method.removesuffix("-all"),
        "lora": {"r": 4, "alpha": 8, "target_modules": targets},
        "data": {"train": str(rows), "format": "tokenized", "max_seq_len": SEQ, "packing": True},
        "train": {"max_steps": 1, "global_batch_size": MBS, "micro_batch_size": MBS, "lr": 1e-3, "seed": 0},
        "precision": precision,
        "distributed": {"strategy": "single"},
        "eval": {"every": 0},
        "output": {"dir": str(out), "log_every": 1},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str, str], dict]:
    """Each case's plan, measured memory, metrics rows and console header."""
    import contextlib
    import io
    import random

    from finetune.commands.run import LaunchOptions, launch
    from finetune.plan.flowchart import chosen_memory
    from finetune.plan.types import Plan
    from finetune.recipe.schema import load_recipe

    root = tmp_path_factory.mktemp("architectures")
    rng = random.Random(0)
    rows = write_jsonl(root / "rows.jsonl", [{"input_ids": [rng.randrange(3, 256) for _ in range(SEQ // 2)]}
                                             for _ in range(64)])
    out: dict[tuple[str, str, str], dict] = {}
    for arch, method, precision in CASES:
        model_dir = root / arch
        if not model_dir.exists():
            arch_model_dir(model_dir, arch)
        run = root / f"{arch}-{method}-{precision}"
        path = write_recipe(root / f"{run.name}.yaml", recipe(model_dir, rows, run, method, precision, arch))
        console = io.StringIO()
        with contextlib.redirect_stdout(console):
            code = launch(str(path), [], LaunchOptions(nproc=1, measure_memory=True))
        assert code == 0, (arch, method, precision)
        plan = Plan.from_dict(json.loads((run / "plan.json").read_text()))
        first = chosen_memory(load_recipe(path), plan, device="cpu", first_step=True)
        measured = int(json.loads((run / "memory.json").read_text())["measured_peak"])
        out[(arch, method, precision)] = {
            "predicted": first.total - first.overhead, "measured": measured, "plan": plan,
            "rows": [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()],
            "console": console.getvalue(), "dir": run,
        }
    return out


def test_every_architecture_plans_and_trains_within_the_plan(runs):
    errors = {case: (r["predicted"] - r["measured"]) / r["measured"] for case, r in runs.items()}
    table = "\n".join(f"{' '.join(c):32s} {100 * e:+.2f}%" for c, e in errors.items())
    print(table)  # shown with -s, and beside a failure
    assert len(errors) == len(CASES)
    assert statistics.median(abs(e) for e in errors.values()) < 0.03, table
    assert max(abs(e) for e in errors.values()) < 0.08, table
    for case, r in runs.items():
        losses = [row["loss"] for row in r["rows"] if "loss" in row]
        assert len(losses) == 1 and 0 < losses[0] < 10, case
    for (arch, method, _precision), r in runs.items():
        if method.endswith("-all"):  # every layer's fused expert weights adapted, and stored in NF4 under QLoRA
            experts, layers = r["plan"].model["experts"], r["plan"].model["moe"]["layers"]
            assert experts["adapted"] == experts["tensors"] == 2 * layers, (arch, method, experts)  # gate_up, down
            assert experts["quantized"] == (experts["tensors"] if method == "qlora-all" else 0), (arch, experts)


def test_mixtures_of_experts_log_their_router_and_say_their_kernels(runs):
    """metrics.jsonl has the experts' load for every MoE run and the load-balancing loss for those whose model
    defines one (top-k when perfectly even, so about top-k at random init); the header names the attention (eager
    for gpt-oss, which has no sdpa) and the experts kernel; dense runs log neither figure."""
    for (arch, _method, _precision), r in runs.items():
        step = next(row for row in r["rows"] if "loss" in row)
        header = r["console"]
        if arch not in MOE_ARCHITECTURES:
            assert "expert_load" not in step and "aux_loss" not in step
            assert "model: attention sdpa\n" in header or "model: attention eager" in header
            continue
        assert step["expert_load"] >= 1.0
        top_k = ARCHITECTURES[arch]["num_experts_per_tok"]
        if arch in ("deepseek_v3", "llama4_text"):  # a bias balances DeepSeek-V3's experts; Llama 4 has no such loss
            assert "aux_loss" not in step
        else:
            assert top_k <= step["aux_loss"] < 2 * top_k, (arch, step)
        assert "experts kernel grouped_mm" in header, header
        attention = "eager (gpt_oss has no sdpa attention)" if arch == "gpt_oss" else "sdpa"
        assert f"model: attention {attention}" in header, header
        assert r["plan"].model["moe"]["top_k"] == top_k


def test_report_draws_the_router_of_a_mixture_of_experts(runs):
    """`finetune report` of a Qwen3-MoE run draws its load-balancing loss and experts' load from metrics.jsonl,
    and its HTML page has the plan's mixture-of-experts facts; a dense run gets no such row."""
    from finetune.commands.report import MOE_PANELS, build_figure, html_page, load_run

    r = runs[("qwen3_moe", "lora", "bf16")]
    fig = build_figure([load_run(r["dir"])])
    axes = {ax.get_title(): ax for ax in fig.axes}
    step = next(row for row in r["rows"] if "loss" in row)
    for title, key in zip(MOE_PANELS, ("aux_loss", "expert_load"), strict=True):
        (line,) = axes[title].lines[:1]
        assert list(line.get_ydata()) == [step[key]]
    page = html_page([load_run(r["dir"])], b"")
    assert "mixture of experts" in page and "active parameters per token" in page
    dense = build_figure([load_run(runs[("qwen3", "lora", "bf16")]["dir"])])
    assert not {ax.get_title() for ax in dense.axes} & set(MOE_PANELS)
