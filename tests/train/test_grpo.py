"""grpo: rewards (built-in and the recipe's own functions), advantages, the schema's and the capability table's
refusals, the plan's rollout memory, and the loss of fixed completions under LoRA with accumulation."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from finetune.errors import UserError
from finetune.objectives.grpo import GrpoObjective, GrpoSettings, advantages
from finetune.objectives.rewards import Rewards
from finetune.recipe.schema import GrpoConfig, Recipe, RecipeError, load_recipe
from tests.support import TINY_MODEL, tiny_recipe, write_recipe

GRPO = {"num_generations": 4, "max_completion_length": 6, "rewards": [{"type": "exact_match"}]}


def _rewards(tmp_path: Path, *rewards: dict) -> Rewards:
    return Rewards.of(GrpoConfig.model_validate({"rewards": list(rewards), "trust_reward_code": True}), tmp_path)


def test_built_in_rewards_score_completions(tmp_path: Path) -> None:
    r = _rewards(
        tmp_path, {"type": "exact_match", "weight": 2.0}, {"type": "regex", "pattern": "[a-z]+"}, {"type": "json"},
        {"type": "length", "target": 4},
    )
    total, each = r.score(["p", "p", "p"], [" cba ", '{"a": 1}', "CBA!!"], ["cba", "cba", None])
    assert each == {
        "exact_match": [1.0, 0.0, 0.0], "regex": [1.0, 0.0, 0.0], "json": [0.0, 1.0, 0.0],
        "length": [-0.25, -1.0, -0.25],
    }
    assert total == [2.0 + 1.0 - 0.25, 1.0 - 1.0, -0.25]


def test_user_reward_function_runs_and_its_error_is_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text(
        "def score(prompt, completion, answer):\n    return float(completion == answer[::-1])\n\n"
        "def broken(prompt, completion, answer):\n    return 1 / 0\n"
    )
    ok = _rewards(tmp_path, {"type": "python", "file": "mine.py", "function": "score"})
    assert ok.score(["p"], ["abc"], ["cba"])[0] == [1.0]
    bad = _rewards(tmp_path, {"type": "python", "file": "mine.py", "function": "broken"})
    with pytest.raises(UserError) as err:
        bad.score(["p"], ["abc"], ["cba"])
    text = str(err.value)
    assert "`broken`" in text and str(tmp_path / "mine.py") in text and "ZeroDivisionError" in text
    assert "\n" not in text and "Traceback" not in text
    with pytest.raises(UserError, match="defines no function `nothing`"):
        _rewards(tmp_path, {"type": "python", "file": "mine.py", "function": "nothing"})


def test_schema_refuses_python_rewards_without_the_opt_in_and_partial_groups() -> None:
    base = {"model": {"path": "m"}, "data": {"train": "t"}}
    with pytest.raises(ValueError, match=r"grpo\.trust_reward_code: true"):
        Recipe.model_validate({**base, "grpo": {"rewards": [{"type": "python", "file": "a.py", "function": "f"}]}})
    with pytest.raises(ValueError, match=r"not whole groups of grpo\.num_generations: 3"):
        Recipe.model_validate({**base, "train": {"objective": "grpo", "global_batch_size": 8},
                               "grpo": {**GRPO, "num_generations": 3}})
    with pytest.raises(ValueError, match=r"grpo\.rewards is empty"):
        Recipe.model_validate({**base, "train": {"objective": "grpo"}, "grpo": {"rewards": []}})
    with pytest.raises(ValueError, match="needs `pattern`"):
        GrpoConfig.model_validate({"rewards": [{"type": "regex"}]})


@pytest.mark.parametrize(("change", "words"), [
    ({"data": {"packing": True}}, "grpo scores each sampled completion on its own row"),
    ({"data": {"format": "text"}}, "grpo samples completions of prompts, which data.format: text rows do not have"),
    ({"data": {"streaming": True}}, "data.streaming: grpo draws whole groups of prompts from data.train"),
])
def test_capability_table_refuses_grpo_cells(tmp_path: Path, change: dict, words: str) -> None:
    recipe = tiny_recipe(tmp_path / "out", train={"objective": "grpo"}, grpo=GRPO)
    for k, v in change.items():
        recipe[k].update(v)
    path = write_recipe(tmp_path / "r.yaml", recipe)
    from finetune.recipe.capabilities import Cell, check

    with pytest.raises((UserError, RecipeError)) as err:
        check(Cell.of_recipe(load_recipe(path).recipe))
    assert words in str(err.value)


def test_advantages_are_normalised_within_groups() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    a = advantages(r, 4, "group")
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std()
    assert torch.allclose(a[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-4))
    assert torch.equal(a[4:], torch.zeros(4))  # a group that agrees teaches nothing
    assert torch.allclose(advantages(r, 4, "none")[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))


@pytest.mark.slow
def test_plan_of_a_grpo_run_counts_the_rollouts(tmp_path: Path) -> None:
    from finetune.plan.flowchart import plan_for_run

    recipe = tiny_recipe(tmp_path / "out", train={"objective": "grpo"}, grpo={**GRPO, "beta": 0.1})
    plan = plan_for_run(load_recipe(write_recipe(tmp_path / "r.yaml", recipe)), nproc=1, nnodes=1, device="cpu")
    m = plan.chosen.memory
    # the reference's kept log-probs alone: 8 completions x (48 + 6) positions x 4 bytes
    assert m.rollout >= 8 * (48 + 6) * 4
    assert m.total == m.params + m.grads + m.optimizer + m.activations + m.buffers + m.overhead + m.rollout
    assert any("Rollouts: 8 completions of up to 6 tokens" in line for line in plan.walk)


def _completions(tok) -> tuple[list[dict], torch.Tensor]:
    from finetune.train.data.batches import Example, collate

    prompt = tok("Reverse the letters.\nabc\nAnswer: ", add_special_tokens=False)["input_ids"]
    rows = []
    for text in ("cba", "cab", "abcabc", "c"):
        c = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(Example(prompt + c, [-100] * len(prompt) + c))
    adv = torch.tensor([1.2, -0.4, -1.0, 0.2])
    whole = collate(rows, tok.pad_token_id)
    return [{**collate(rows[i : i + 1], tok.pad_token_id), "advantages": adv[i : i + 1]} for i in range(4)], {
        **whole, "advantages": adv}


@pytest.mark.slow
def test_lora_accumulation_gives_the_whole_batch_loss() -> None:
    """Fixed completions under LoRA: four micro-batches of one completion, each summed loss divided by the
    whole batch's count (completions or tokens), give the one-batch loss and gradients."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from finetune.objectives.grpo import count_of

    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights=False))
    micro, whole = _completions(tok)
    for mb in (whole, *micro):
        mb.pop("attention_mask")
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        one_model, other = copy.deepcopy(model), copy.deepcopy(model)
        s = GrpoSettings(num_generations=4, max_completion_length=8, beta=0.0, loss_type=loss_type)
        total = count_of(s, whole["labels"][:, 1:] != -100)
        one, _ = GrpoObjective(s)(one_model, whole)
        (one / total).backward()
        summed = torch.zeros(())
        for mb in micro:
            part, _ = GrpoObjective(s)(other, mb)
            (part / total).backward()
            summed += part.detach()
        assert abs(float(one) - float(summed)) <= 1e-4 * max(1.0, abs(float(one))), loss_type
        grads = {n: p.grad for n, p in one_model.named_parameters() if p.requires_grad}
        for n, p in other.named_parameters():
            if p.requires_grad:
                assert torch.allclose(p.grad, grads[n], atol=1e-6, rtol=1e-4), (loss_type, n)


@pytest.mark.slow
def test_two_step_run_is_measured_within_ten_percent_of_its_plan(tmp_path: Path) -> None:
    """A 2-step grpo run with the KL term (the reference's log-probabilities kept through the step) under
    --measure-memory: the plan counts the rollout (memory and seconds), the steps' measured peak is within 10% of
    the plan's, and so is the first rollout's (sampling and scoring) beside the plan's rollout phase."""
    import json

    from tests.support import finetune_run

    out = tmp_path / "out"
    recipe = tiny_recipe(
        out, train={"objective": "grpo", "max_steps": 2}, grpo={**GRPO, "max_completion_length": 8, "beta": 0.1},
        eval={"every": 0, "at_start": False, "max_samples": 4},
    )
    proc = finetune_run(write_recipe(tmp_path / "r.yaml", recipe), "--measure-memory")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    chosen = json.loads((out / "plan.json").read_text())["chosen"]
    # the kept reference log-probabilities at least: 8 completions x (48 + 8) positions x 4 bytes
    assert chosen["memory"]["rollout"] >= 8 * (48 + 8) * 4
    assert chosen["time"]["rollout"] > 0 and chosen["time"]["step"] > chosen["time"]["compute"]
    memory = json.loads((out / "memory.json").read_text())
    assert memory["steps_measured"] == 2 and abs(memory["error"]) <= 0.10, memory["error"]
    rollout = memory["phases"]["rollout"]
    # the policy and its frozen copy (2 x 12.1 MB) and the sampling's transients, measured on the first step
    assert rollout["predicted"] > chosen["memory"]["params"] and abs(rollout["error"]) <= 0.10, rollout
    assert "memory, rollout: predicted" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout_seconds"] > 0 for r in rows if "loss" in r)


def test_row_sampler_draws_each_row_alike_in_any_share_of_the_batch() -> None:
    """The rollout's sampler: two ranks each sampling half the rows (their own generator, seeded alike) pick
    what one process sampling all rows picks; the draws follow the softmax at the temperature and never leave
    top_p's nucleus."""
    from finetune.model.generation import row_sampler

    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(1)) * 2
    whole = row_sampler(0.7, 1.0, torch.Generator().manual_seed(5), rows=6)(logits)
    halves = [row_sampler(0.7, 1.0, torch.Generator().manual_seed(5), rows=6, first=f)(logits[f : f + 3]) for f in (0, 3)]
    assert torch.equal(torch.cat(halves), whole)
    pick = row_sampler(0.7, 1.0, torch.Generator().manual_seed(0), rows=1)
    counts = torch.bincount(torch.cat([pick(logits[:1]) for _ in range(4000)]).reshape(-1), minlength=10).double()
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    assert (counts / 4000 - expected).abs().max() < 0.03, (counts / 4000, expected)
    nucleus = row_sampler(1.0, 0.5, torch.Generator().manual_seed(0), rows=6)
    probs = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    allowed = [set(probs.indices[i][(probs.values[i].cumsum(0) - probs.values[i]) < 0.5].tolist()) for i in range(6)]
    for _ in range(200):
        for i, t in enumerate(nucleus(logits).reshape(-1).tolist()):
            assert t in allowed[i]


@pytest.mark.slow
def test_a_raising_reward_function_stops_the_run_with_one_sentence(tmp_path: Path) -> None:
    """Through `finetune run`: a python reward that raises at the first step's rollout is one line naming the
    file and the function, exit 2 (a user's mistake), no traceback, no model saved."""
    from tests.support import finetune_run

    (tmp_path / "mine.py").write_text("def score(prompt, completion, answer):\n    return {}[completion]\n")
    recipe = tiny_recipe(
        tmp_path / "out", train={"objective": "grpo", "max_steps": 2},
        grpo={**GRPO, "rewards": [{"type": "python", "file": "mine.py", "function": "score"}], "trust_reward_code": True},
        eval={"every": 0, "at_start": False},
    )
    proc = finetune_run(write_recipe(tmp_path / "r.yaml", recipe))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"error: grpo.rewards.0: the reward function `score` of {tmp_path / 'mine.py'} raised KeyError: "
    ), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_mixture_of_experts_keeps_its_router_figures_beside_grpos(tmp_path: Path) -> None:
    """grpo on a Qwen3-MoE (8 experts, top-2): each step's row has the rollout's figures and the router's expert
    load (its training forwards' routing counted, as sft's); the load-balancing loss is sft's only, so no
    aux_loss."""
    import json

    from finetune.commands.run import LaunchOptions, launch
    from tests.support import arch_model_dir

    model = arch_model_dir(tmp_path / "moe", "qwen3_moe")
    recipe = tiny_recipe(
        tmp_path / "out", model={"path": str(model), "init": "random"}, train={"objective": "grpo", "max_steps": 2},
        grpo=GRPO, eval={"every": 0, "at_start": False, "max_samples": 2},
    )
    assert launch(str(write_recipe(tmp_path / "r.yaml", recipe)), [], LaunchOptions()) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    for r in [r for r in rows if "loss" in r]:
        assert {"reward", "reward_std", "kl", "completion_length", "clip_ratio", "expert_load"} <= set(r), sorted(r)
        assert r["expert_load"] >= 1.0 and "aux_loss" not in r
