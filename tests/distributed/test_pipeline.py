"""Pipeline parallelism through the real CLI on gloo: loss parity with one process, resume across pipeline
layouts, merge of a pipelined LoRA run, and the capability table's refusals.

The same fp32 recipe (4-layer Llama, global batch 8 in micro-batches of 2: 4 pipeline micro-batches per
step, 8 steps) as one process and as ``--set distributed.pp=2``: 1F1B (full fine-tuning), GPipe (LoRA, with
evaluation), pp 2 x dp 2 under fsdp, pp 2 x tp 2 with sequence parallelism (the stages pass each tp rank's
rows; with evaluation), and interleaved 1F1B with 2 stages per rank and 2 row widths (``distributed.pp_buckets``:
the schedule is rebuilt for each step's width). Every one gives
the single process's losses and gradient norms within 1e-5 relative and its final weights within 1e-4: the
last stage normalises each micro-batch's summed loss by the step's global target-token count, with the
schedule's own scaling off. Stages keep the whole model's names, so a DCP checkpoint saved by 2 stages
resumes on one process and the reverse.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from finetune.commands.run import LaunchOptions, launch
from tests.support import (
    RECIPES,
    WEIGHT_ATOL,
    clean_env,
    finetune_run,
    max_rel,
    max_weight_diff,
    micro_model_dir,
    parity_recipe,
    step_rows,
    write_recipe,
)

STEPS = 8
RTOL = 1e-5  # losses and gradient norms, relative
# Final weights, absolute: the suite's parity tolerance. After 8 AdamW steps a weight whose gradient is near
# zero moves by up to lr whatever its sign's last bits, so the last float bits of a stage boundary's sums (which
# differ between CPUs' kernels) show in the weights at ~1e-5 while losses and gradient norms agree to 1e-7.
ATOL = WEIGHT_ATOL

# layout -> (method, distributed.strategy, processes, --set arguments)
LAYOUTS = {
    "full-single": ("full", "single", 1, []),
    "lora-single": ("lora", "single", 1, []),
    "full-1f1b": ("full", "ddp", 2, ["distributed.pp=2", "distributed.pp_schedule=1f1b"]),
    "lora-gpipe": ("lora", "ddp", 2, ["distributed.pp=2", "distributed.pp_schedule=gpipe"]),
    "full-pp2xdp2": ("full", "fsdp", 4, ["distributed.pp=2"]),
    "full-pp2xtp2": ("full", "ddp", 4, ["distributed.pp=2", "distributed.tp=2"]),
    # with 2 row widths (44 and 88: the reverse task's steps are 43 or 45 tokens wide, so both run, in turn)
    "full-interleaved": ("full", "ddp", 2, ["distributed.pp=2", "distributed.pp_schedule=interleaved-1f1b",
                                            "data.max_seq_len=88", "distributed.pp_buckets=2"]),
}


@pytest.fixture(scope="module")
def pp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama's tokenizer with 4 small decoder layers (2 KV heads, so tp 2 splits them)."""
    return micro_model_dir(
        tmp_path_factory.mktemp("pp-llama"), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )


class PPRuns:
    """One run per layout, shared by the assertions (the full runs checkpoint at step 4)."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        self.root, self.model_dir = root, model_dir
        self.done: dict[str, Path] = {}
        self.seconds: dict[str, float] = {}

    def recipe(self, layout: str, out: Path) -> Path:
        method, strategy, _, _ = LAYOUTS[layout]
        r = parity_recipe(self.model_dir, out, method, strategy)
        r["train"]["max_steps"] = STEPS
        r["output"]["save_every"] = 4
        if method == "lora" or layout in ("full-single", "full-pp2xdp2", "full-pp2xtp2"):  # evaluation, through the stages
            r["data"]["eval"] = str(RECIPES / "data/reverse/eval.jsonl")
            r["eval"] = {"max_samples": 8, "max_new_tokens": 4, "batch_size": 4, "at_start": False}
        return write_recipe(self.root / f"{layout}.yaml", r)

    def run(self, layout: str, out: Path, *extra: str) -> str:
        """``layout``'s recipe into ``out`` (``extra``: more CLI arguments); the run's output."""
        _, _, nproc, sets = LAYOUTS[layout]
        recipe = self.recipe(layout, out)
        if nproc == 1 and not extra:
            assert launch(str(recipe), [], LaunchOptions(nproc=1)) == 0
            return ""
        args = ["--nproc", str(nproc), *[a for s in sets for a in ("--set", s)], *extra]
        proc = finetune_run(recipe, *args, env=clean_env(OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        assert "Traceback" not in proc.stderr
        return proc.stdout + proc.stderr

    def get(self, layout: str) -> Path:
        if layout not in self.done:
            out = self.root / layout
            self.run(layout, out)
            self.done[layout] = out
        return self.done[layout]


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory: pytest.TempPathFactory, pp_model: Path) -> PPRuns:
    return PPRuns(tmp_path_factory.mktemp("pp-runs"), pp_model)


def _assert_parity(got: Path, want: Path, weights: str) -> None:
    a, b = step_rows(got), step_rows(want)
    assert [r["step"] for r in a] == list(range(1, STEPS + 1))
    assert max_rel([r["loss"] for r in a], [r["loss"] for r in b]) <= RTOL
    assert max_rel([r["grad_norm"] for r in a], [r["grad_norm"] for r in b]) <= RTOL
    assert max_weight_diff(got / weights, want / weights) <= ATOL


def _assert_same_evaluation(got: Path, want: Path) -> None:
    """The final evaluation's loss (within 1e-5) and exact match of ``got`` are ``want``'s."""
    last = [
        [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line][-1]
        for d in (got, want)
    ]
    assert abs(last[0]["eval_loss"] - last[1]["eval_loss"]) <= RTOL * last[1]["eval_loss"]
    assert last[0]["eval_exact_match"] == last[1]["eval_exact_match"]


@pytest.mark.dist
def test_two_stages_match_one_process_full_1f1b_and_lora_gpipe(pp_runs: PPRuns, tmp_path: Path) -> None:
    """Full fine-tuning under 1F1B and LoRA under GPipe on 2 stages: the single process's losses, norms and
    weights; the LoRA run's evaluation (loss, exact match through the stages) is the single run's, its
    adapter holds every stage's layers, and ``finetune merge`` folds it as it folds the single run's."""
    from finetune.merge import merge

    full, single = pp_runs.get("full-1f1b"), pp_runs.get("full-single")
    _assert_parity(full, single, "model.safetensors")
    assert full.joinpath("config.json").is_file()
    assert len(load_file(full / "model.safetensors")) == len(load_file(single / "model.safetensors"))
    plan = json.loads((full / "plan.json").read_text())["execution"]
    assert (plan["pp"], plan["pp_layers"], plan["dp"]) == (2, [2, 2], 1)
    assert step_rows(full)[-1]["loss"] < 0.85 * step_rows(full)[0]["loss"]

    lora, lora_single = pp_runs.get("lora-gpipe"), pp_runs.get("lora-single")
    _assert_parity(lora, lora_single, "adapter_model.safetensors")
    adapter = load_file(lora / "adapter_model.safetensors")
    assert len(adapter) == 4 * 2 * 2  # 4 layers x (q, v) x (A, B): both stages' adapters
    assert "base_model.model.model.layers.3.self_attn.v_proj.lora_B.weight" in adapter
    _assert_same_evaluation(lora, lora_single)
    merge(lora, tmp_path / "merged-pp")
    merge(lora_single, tmp_path / "merged-single")
    merged = max_weight_diff(tmp_path / "merged-pp" / "model.safetensors", tmp_path / "merged-single" / "model.safetensors")
    assert merged <= 1e-5  # LoRA trains few weights: the merged models agree as the adapters do


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["full-pp2xdp2", "full-pp2xtp2", "full-interleaved"])
def test_pipeline_composes_with_fsdp_tp_and_interleaving(pp_runs: PPRuns, layout: str) -> None:
    """pp 2 x dp 2 (fsdp over each stage, with the final evaluation through the sharded stages), pp 2 x tp 2
    (each stage's linears split, with sequence parallelism: the stages pass each tp rank's rows, the last
    stage's head and loss run on them; the final evaluation's loss and greedy exact match through the stages)
    and interleaved 1F1B (2 stages per rank, 1 layer each; the steps padded to 44 or 88 columns, whichever holds
    their rows) on a (pp, dp, tp) mesh: the single process's run."""
    got, single = pp_runs.get(layout), pp_runs.get("full-single")
    _assert_parity(got, single, "model.safetensors")
    if layout in ("full-pp2xdp2", "full-pp2xtp2"):
        _assert_same_evaluation(got, single)
    execution = json.loads((got / "plan.json").read_text())["execution"]
    assert execution["sequence_parallel"] is (layout == "full-pp2xtp2")
    want = {"full-pp2xdp2": (2, 2, 1, [2, 2]), "full-pp2xtp2": (2, 1, 2, [2, 2]), "full-interleaved": (2, 1, 1, [1, 1, 1, 1])}
    assert (execution["pp"], execution["dp"], execution["tp"], execution["pp_layers"]) == want[layout]
    if layout == "full-interleaved":
        recipe = yaml.safe_load((got / "recipe.yaml").read_text())
        assert (recipe["data"]["max_seq_len"], recipe["distributed"]["pp_buckets"]) == (88, 2)


@pytest.mark.dist
def test_checkpoint_resumes_across_pipeline_layouts(pp_runs: PPRuns) -> None:
    """The step-4 checkpoint of 2 stages resumes on one process, and one process's on 2 stages: DCP matches the
    whole model's names, model and AdamW state, so steps 5-8 and the final weights are the uninterrupted run's."""
    for saved, resumed_as in (("full-1f1b", "full-single"), ("full-single", "full-1f1b")):
        whole = pp_runs.get(saved)
        out = pp_runs.root / f"{saved}-as-{resumed_as}"
        said = pp_runs.run(resumed_as, out, "--resume", str(whole / "checkpoints" / "step-4"))
        assert "resharded from" in said and " x2 pp 2" in said, said[-2000:]  # the layout it came from or goes to
        got, want = step_rows(out), step_rows(whole)[4:]
        assert [r["step"] for r in got] == list(range(5, STEPS + 1))
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want, strict=True)) <= 1e-5
        assert max_weight_diff(out / "model.safetensors", whole / "model.safetensors") <= 1e-5
    shutil.rmtree(pp_runs.root / "full-single-as-full-1f1b" / "checkpoints", ignore_errors=True)


REFUSED = [
    ({"method": "qlora"}, "distributed.pp: 2 with method qlora is not supported"),
    ({"data": {"packing": True}}, "data.packing: packed rows' document masks do not cross the stages"),
    ({"distributed": {"strategy": "zero1"}}, "distributed.strategy: zero1 cannot run over"),
    ({"train": {"compile": True}}, "distributed.pp: 2 with train.compile: true is not supported"),
    # what the model decides (4 decoder layers): read from its config by validate, as plan and run read it
    ({"distributed": {"pp_layers": [3, 2]}}, "distributed.pp_layers: [3, 2] has 2 stages of 5 layers; pp 2 x 1"),
    ({"distributed": {"pp": 8}}, "distributed.pp: 8 ranks x 1 stage each need at least 8 decoder layers and the "
                                 "model has 4; use a pp of at most 4"),
    ({"distributed": {"pp": 1, "pp_layers": [2, 2]}}, "distributed.pp_layers: set without a pipeline"),
]


def test_pipeline_refusals_name_the_key(tmp_path: Path, pp_model: Path) -> None:
    """What pipeline stages do not run is refused by ``finetune validate`` and ``finetune run`` in one sentence
    naming the key, before anything is written."""
    from typer.testing import CliRunner

    from finetune.cli import app

    for i, (changes, key) in enumerate(REFUSED):
        r = parity_recipe(pp_model, tmp_path / "out", "full", "ddp")
        r["distributed"].update({"pp": 2, "nproc": 2})
        for section, value in changes.items():
            if isinstance(value, dict):
                r[section].update(value)
            else:
                r[section] = value
        recipe = write_recipe(tmp_path / f"r{i}.yaml", r)
        for command in ("validate", "run") if i == 0 else ("validate",):
            res = CliRunner().invoke(app, [command, str(recipe)])
            assert res.exit_code == 2, res.output
            assert key in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_a_tied_head_is_refused_by_validate_plan_and_run(tmp_path: Path) -> None:
    """A model whose head is its input embeddings cannot be cut into stages: one sentence from validate, plan
    and run alike, naming distributed.pp."""
    from typer.testing import CliRunner

    from finetune.cli import app

    tied = micro_model_dir(tmp_path / "tied", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    r = parity_recipe(tied, tmp_path / "out", "full", "ddp")
    r["distributed"].update({"pp": 2, "nproc": 2})
    recipe = write_recipe(tmp_path / "tied.yaml", r)
    for command in ("validate", "plan", "run"):
        res = CliRunner().invoke(app, [command, str(recipe)])
        assert res.exit_code == 2, res.output
        assert "distributed.pp: llama ties its output head to its input embeddings" in res.output, res.output
    assert not (tmp_path / "out").exists()
