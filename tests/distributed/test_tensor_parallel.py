"""Tensor parallelism through the real CLI on gloo: loss parity of TP alone and of a 2 x 2 (dp x tp) mesh.

The same fp32 recipe (global batch 8, 10 steps) as one process, as ``--nproc 2 --set distributed.tp=2``
(one replica split over 2 ranks) and as ``--nproc 4`` with tp 2 under fsdp (FSDP2 over 2 replicas of a TP
pair): the same per-step losses and gradient norms, and the same saved weights (a plain HF model, or the
PEFT adapter, gathered from the DTensors). The model is a 2-block Llama with 4 heads and 2 KV heads (so
tp 2 splits both), random weights from the seed. These runs use sequence parallelism (on by default), on
right-padded rows whose lengths the ranks split unevenly; packed rows are compared too, and a run without
sequence parallelism is compared with one with it, memory included. Bad ``distributed.tp`` values are refused
in one sentence before any process starts.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from finetune.commands.run import LaunchOptions, launch
from finetune.errors import UserError
from tests.support import (
    LOSS_RTOL,
    STEPS,
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

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama's tokenizer with a 2-block config whose 4 heads and 2 KV heads split over tp 2."""
    return micro_model_dir(
        tmp_path_factory.mktemp("tp-llama"), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )


def tp_recipe(model_dir: Path, out: Path, method: str, strategy: str) -> dict:
    """The parity recipe, LoRA on a column-parallel (q, v) and a row-parallel (o, down) pair of targets."""
    r = parity_recipe(model_dir, out, method, strategy)
    r["lora"]["target_modules"] = ["q_proj", "v_proj", "o_proj", "down_proj"]
    return r


# mesh -> (distributed.strategy, processes, extra CLI arguments)
MESHES = {
    "single": ("single", 1, []),
    "tp2": ("auto", 2, ["--set", "distributed.tp=2"]),
    "2x2": ("fsdp", 4, ["--set", "distributed.tp=2"]),
}


class TPRuns:
    """One run per (method, mesh), shared by the assertions; mesh is single, tp2 (2 ranks) or 2x2 (4)."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        self.root, self.model_dir = root, model_dir
        self.done: dict[str, Path] = {}

    def recipe(self, method: str, mesh: str, out: Path, **train: int) -> Path:
        r = tp_recipe(self.model_dir, out, method, MESHES[mesh][0])
        r["train"].update(train)
        r["output"]["save_every"] = 5  # a TP checkpoint at step 5, resumed below
        return write_recipe(self.root / f"{method}-{mesh}.yaml", r)

    def get(self, method: str, mesh: str) -> Path:
        key = f"{method}-{mesh}"
        if key not in self.done:
            out = self.root / key
            recipe = self.recipe(method, mesh, out)
            _, nproc, extra = MESHES[mesh]
            if nproc == 1:
                assert launch(str(recipe), [], LaunchOptions(nproc=1)) == 0
            else:
                proc = finetune_run(recipe, "--nproc", str(nproc), *extra, env=clean_env(OMP_NUM_THREADS="1"))
                assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
                assert "Traceback" not in proc.stderr and "redistributing" not in proc.stderr
            self.done[key] = out
        return self.done[key]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory, tp_model: Path) -> TPRuns:
    return TPRuns(tmp_path_factory.mktemp("tp-runs"), tp_model)


@pytest.mark.parametrize("mesh", ["tp2", "2x2"])
def test_full_finetune_tp_parity_with_single_process(tp_runs: TPRuns, mesh: str) -> None:
    single, tp = tp_runs.get("full", "single"), tp_runs.get("full", mesh)
    want, got = step_rows(single), step_rows(tp)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert max_rel([r["loss"] for r in got], [r["loss"] for r in want]) <= LOSS_RTOL
    assert max_rel([r["grad_norm"] for r in got], [r["grad_norm"] for r in want]) <= LOSS_RTOL
    assert got[-1]["loss"] < 0.8 * got[0]["loss"]
    # The final save is a plain HF model: whole (gathered) tensors, the single run's names and shapes.
    assert max_weight_diff(tp / "model.safetensors", single / "model.safetensors") <= WEIGHT_ATOL
    assert load_file(tp / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    plan = json.loads((tp / "plan.json").read_text())
    assert (plan["chosen"]["tp"], plan["execution"]["tp"], plan["execution"]["dp"]) == (
        2,
        2,
        1 if mesh == "tp2" else 2,
    )
    # Each replica runs the whole micro-batch schedule: accumulation 4 on one replica, 2 on two.
    assert plan["chosen"]["grad_accum_steps"] == (4 if mesh == "tp2" else 2)


@pytest.mark.parametrize("mesh", ["tp2", "2x2"])
def test_lora_tp_parity_and_merge(tp_runs: TPRuns, mesh: str, tmp_path: Path) -> None:
    """Column-split adapters (lora_B on q/v, lora_A on o/down) train as one process does; the adapter is
    saved whole and ``finetune merge`` folds it as it folds the single run's."""
    from finetune.merge import merge

    single, tp = tp_runs.get("lora", "single"), tp_runs.get("lora", mesh)
    assert max_rel([r["loss"] for r in step_rows(tp)], [r["loss"] for r in step_rows(single)]) <= LOSS_RTOL
    a = load_file(tp / "adapter_model.safetensors")
    assert len(a) == 2 * 4 * 2 and all("lora_" in k for k in a)  # 2 blocks x 4 targets x (A, B)
    assert a["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (64, 4)
    assert a["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"].shape == (4, 64)
    assert (
        max_weight_diff(tp / "adapter_model.safetensors", single / "adapter_model.safetensors") <= WEIGHT_ATOL
    )
    if mesh == "tp2":
        merge(tp, tmp_path / "merged-tp")
        merge(single, tmp_path / "merged-single")
        assert (
            max_weight_diff(
                tmp_path / "merged-tp" / "model.safetensors", tmp_path / "merged-single" / "model.safetensors"
            )
            <= WEIGHT_ATOL
        )


@pytest.mark.parametrize("method", ["full", "lora"])
def test_tp_checkpoint_resumes_on_the_same_mesh(tp_runs: TPRuns, method: str) -> None:
    """A copy of the tp 2 run, resumed from its step-5 checkpoint, computes the uninterrupted run's steps
    6-10 and weights (model or adapter and AdamW state gathered from DTensors, put back on the same mesh)."""
    whole = tp_runs.get(method, "tp2")
    out = tp_runs.root / f"{method}-tp2-resumed"
    shutil.copytree(whole, out)
    recipe = tp_runs.recipe(method, "tp2", out)
    proc = finetune_run(
        recipe,
        "--nproc",
        "2",
        "--set",
        "distributed.tp=2",
        "--resume",
        str(out / "checkpoints" / "step-5"),
        env=clean_env(OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got, want = step_rows(out), step_rows(whole)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert max_rel([r["loss"] for r in got[5:]], [r["loss"] for r in want[5:]]) <= 1e-6
    weights = "model.safetensors" if method == "full" else "adapter_model.safetensors"
    assert max_weight_diff(out / weights, whole / weights) <= 1e-6


def _resume_as(tp_runs: TPRuns, saved: str, mesh: str) -> tuple[Path, str]:
    """The full run's step-5 checkpoint of ``saved`` resumed on ``mesh`` in a new output.dir: (dir, output)."""
    out = tp_runs.root / f"full-{saved}-as-{mesh}"
    recipe = tp_runs.recipe("full", mesh, out)
    ckpt = str(tp_runs.get("full", saved) / "checkpoints" / "step-5")
    _, nproc, extra = MESHES[mesh]
    args = ["--nproc", str(nproc), *extra, "--resume", ckpt]
    proc = finetune_run(recipe, *args, env=clean_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("saved", "mesh", "note"), [("tp2", "single", "tp 2 to single x1"), ("single", "tp2", "x1 to ")]
)
def test_tp_checkpoint_resumes_on_another_tp_degree(
    tp_runs: TPRuns, saved: str, mesh: str, note: str
) -> None:
    """A full run's step-5 checkpoint saved with tp 2 (2 ranks) resumes as one process (tp 1), and one saved
    by one process resumes with tp 2: DCP re-slices the DTensors. Steps 6-10 give the uninterrupted run's
    losses and final weights within 1e-5 (fp32): the global batch, hence the data order, is the same at any
    dp."""
    out, said = _resume_as(tp_runs, saved, mesh)
    assert "resharded from" in said and note in said
    whole = tp_runs.get("full", saved)
    got, want = step_rows(out), step_rows(whole)[5:]
    assert [r["step"] for r in got] == list(range(6, STEPS + 1))
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want, strict=True))
    weight_diff = max_weight_diff(out / "model.safetensors", whole / "model.safetensors")
    print(f"tp resume {saved} -> {mesh}: max |loss diff| {loss_diff:.2e}, |weight diff| {weight_diff:.2e}")
    assert loss_diff <= 1e-5 and weight_diff <= 1e-5


# ------------------------------------------------------------------------- refused before any process


@pytest.mark.parametrize(
    ("sets", "nproc", "message"),
    [
        (
            ["distributed.tp=4"],
            2,
            r"^distributed.tp: 4 is more than the 2 processes of a node \(--nproc\); tensor parallelism stays inside "
            r"a node: use a tp of at most 2$",
        ),
        (
            ["distributed.tp=2", "method=qlora"],
            2,
            r"^(--set: )?distributed.tp: 2 with method qlora is not supported",  # refused with the recipe's checks
        ),
        (
            ["distributed.tp=2", "distributed.strategy=ddp"],
            4,
            r"^distributed.strategy: ddp cannot replicate a tensor-parallel model over the 2 data-parallel groups",
        ),
        (
            ["distributed.tp=3"],
            6,
            r"^distributed.tp: 3 does not divide the model's 4 attention heads "
            r"\(num_attention_heads\); use a tp that divides it, e.g. 2$",
        ),
        (
            ["distributed.tp=4"],
            4,
            r"^distributed.tp: 4 does not divide the model's 2 KV heads \(num_key_value_heads\); "
            r"use a tp that divides it, e.g. 2$",
        ),
    ],
)
def test_bad_tp_is_one_sentence_before_any_process(
    tp_model: Path, tmp_path: Path, sets: list[str], nproc: int, message: str
) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", tp_recipe(tp_model, tmp_path / "out", "full", "auto"))
    from finetune.recipe.schema import RecipeError

    with pytest.raises((UserError, RecipeError), match=message):
        launch(str(recipe), sets, LaunchOptions(nproc=nproc))
    assert not (tmp_path / "out").exists()  # nothing written, no worker started


def test_tp_with_strategy_single_is_a_recipe_error(tp_model: Path, tmp_path: Path) -> None:
    """Caught by the capability table from the recipe (so `finetune validate` says it too), before planning or
    any process, in the planner's words."""
    from finetune.recipe.schema import RecipeError

    recipe = write_recipe(tmp_path / "r.yaml", tp_recipe(tp_model, tmp_path / "out", "full", "single"))
    with pytest.raises(RecipeError) as err:
        launch(str(recipe), ["distributed.tp=2"], LaunchOptions(nproc=2))
    assert re.fullmatch(
        r"--set: distributed\.tp: 2 splits the model over 2 processes, but distributed\.strategy is single "
        r"\(one process\); use auto, ddp, zero2 or fsdp, or distributed\.tp: 1",
        str(err.value),
    )
    assert not (tmp_path / "out").exists()


def test_bad_tp_through_the_cli_exits_2_with_one_line(tp_model: Path, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", tp_recipe(tp_model, tmp_path / "out", "full", "auto"))
    proc = finetune_run(recipe, "--nproc", "2", "--set", "distributed.tp=4")
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert errors == [
        "error: distributed.tp: 4 is more than the 2 processes of a node (--nproc); tensor "
        "parallelism stays inside a node: use a tp of at most 2"
    ], proc.stderr[-2000:]
    bad = subprocess.run(
        [*proc.args[:4], str(recipe), "--set", "distributed.tp=0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert bad.returncode == 2 and "distributed.tp" in bad.stderr and "Traceback" not in bad.stderr


def test_architecture_without_a_tp_plan_is_one_sentence() -> None:
    from transformers import GPT2Config

    from finetune.plan.tensor_parallel import tp_problem

    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, architectures=["GPT2LMHeadModel"])
    assert tp_problem(config, 2) == (
        "distributed.tp: GPT2LMHeadModel has no tensor-parallel plan in transformers (config.base_model_tp_plan); "
        "set distributed.tp: 1 and shard it with fsdp instead"
    )


# ------------------------------------------------------------------------------- sequence parallelism


@pytest.mark.parametrize("method", ["full"])
def test_sequence_parallel_on_packed_rows_matches_one_process(tp_runs: TPRuns, method: str) -> None:
    """Packed rows (several documents a row, their positions restarting) split over the sequence of 2 ranks:
    8 fp32 steps give the single process's losses within 1e-5 relative and its weights within 1e-5 (the
    documents' boundaries, the rotary positions and the fused head's target rows of each rank's half).
    LoRA under sequence parallelism is the parity test above (tp runs take it by default)."""
    outs = {}
    for mesh in ("single", "tp2"):
        out = tp_runs.root / f"{method}-{mesh}-packed"
        r = tp_recipe(tp_runs.model_dir, out, method, MESHES[mesh][0])
        r["data"]["packing"] = True
        r["train"]["max_steps"] = 8
        recipe = write_recipe(tp_runs.root / f"{method}-{mesh}-packed.yaml", r)
        if mesh == "single":
            assert launch(str(recipe), [], LaunchOptions(nproc=1)) == 0
        else:
            proc = finetune_run(recipe, "--nproc", "2", *MESHES[mesh][2], env=clean_env(OMP_NUM_THREADS="1"))
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
            assert json.loads((out / "plan.json").read_text())["execution"]["sequence_parallel"] is True
        outs[mesh] = out
    got, want = step_rows(outs["tp2"]), step_rows(outs["single"])
    weights = "model.safetensors" if method == "full" else "adapter_model.safetensors"
    loss_rel = max_rel([r["loss"] for r in got], [r["loss"] for r in want])
    weight_diff = max_weight_diff(outs["tp2"] / weights, outs["single"] / weights)
    print(f"sequence parallel {method} packed: loss rel {loss_rel:.1e}, weight diff {weight_diff:.1e}")
    assert len(got) == 8 and loss_rel <= 1e-5 and weight_diff <= 1e-5


@pytest.mark.slow
def test_sequence_parallel_lowers_the_measured_peak_by_what_the_plan_says(tmp_path: Path) -> None:
    """The tiny model (hidden 256, 4 blocks) at 256 tokens x micro-batch 4 (packed rows), tp 2 on 2 processes,
    full fp32, one step with ``--measure-memory``: with sequence parallelism each rank's measured peak is lower
    than without by what the plan predicts (the norms' saved tensors, the embeddings' output and the head's
    rows on half the positions), each prediction within 5% of its measurement, and the losses are the same."""
    from tests.support import RECIPES, tiny_recipe, write_jsonl

    lines = (RECIPES / "data/reverse/train.jsonl").read_text().splitlines()[:160]  # > 4 rows of 256 tokens
    data = write_jsonl(tmp_path / "train.jsonl", [json.loads(line) for line in lines])
    mem, losses = {}, {}
    for sp in (True, False):
        out = tmp_path / f"sp-{sp}"
        r = tiny_recipe(
            out, data={"train": str(data), "max_seq_len": 256, "packing": True}, eval={"at_start": False, "every": 0},
            train={"max_steps": 1, "global_batch_size": 4, "micro_batch_size": 4},
            distributed={"strategy": "auto", "nproc": 2, "tp": 2, "sequence_parallel": sp},
        )
        del r["data"]["eval"]
        proc = finetune_run(write_recipe(tmp_path / f"sp-{sp}.yaml", r), "--measure-memory",
                            env=clean_env(OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        mem[sp] = json.loads((out / "memory.json").read_text())
        losses[sp] = [row["loss"] for row in step_rows(out)]
    for sp, m in mem.items():
        print(f"sequence_parallel {sp}: predicted {m['predicted'] / 2**20:.2f} MiB, measured "
              f"{m['measured_peak'] / 2**20:.2f} MiB ({100 * m['error']:+.2f}%)")
        assert abs(m["error"]) <= 0.05, m
    saved, predicted = (mem[False][k] - mem[True][k] for k in ("measured_peak", "predicted"))
    assert saved > 0.1 * mem[False]["measured_peak"]  # about an eighth of this rank's peak
    assert abs(saved - predicted) <= 0.05 * saved
    assert max_rel(losses[True], losses[False]) <= 1e-5
