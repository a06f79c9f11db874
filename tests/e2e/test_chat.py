"""`finetune chat` through the real CLI: two LoRA runs on one base, driven in a real terminal (a pty), switched
with /adapter; --prompt and --input/--output answering as the runs' own greedy evaluation did; bad input as one
sentence with exit 2 and nothing written; the generation loop's extensions leave evaluation's result unchanged.

The runs train LoRA adapters on a base drawn from a seed with the tiny Llama's config and initializer_range 0.1.
The quickstart's LoRA recipes start from its full fine-tune (300 steps), and LoRA on the tiny Llama's own random
init (initializer_range 0.02) learns far slower; on these larger random features it memorises four words of a
task: exact match 100% for both tasks after 10 steps (docs/benchmarks.md). Each adapter learns its own task on
the same four words (reversed, in capitals), so an answer tells which adapter gave it.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import subprocess
import sys
import time
from contextlib import nullcontext, redirect_stdout, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from finetune.cli import app
from finetune.commands.run import LaunchOptions, launch
from tests.support import clean_env, micro_model_dir, tiny_recipe, write_jsonl, write_recipe

WORDS = ["abc", "hello", "tiny", "lora"]
TASKS = {
    "rev": ("Reverse the letters.", lambda w: w[::-1]),
    "up": ("Write in capitals.", str.upper),
}
STEPS = 10
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")


@dataclass
class Run:
    """A finished LoRA run: its output.dir, its data, what its final evaluation printed and measured."""

    out: Path
    data: Path
    samples: list[tuple[str, str]]  # (expected, generated) as the run printed them
    exact_match: float


def _samples(stdout: str) -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in re.finditer(r"expected\s+'([^']*)' generated '([^']*)'", stdout)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Two LoRA runs of one seeded base, one per task (the four words as train and eval data)."""
    tmp = tmp_path_factory.mktemp("chat-runs")
    return {task: train(tmp, task, "lora") for task in TASKS}


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A QLoRA run of the reversing task (its base quantized to 4-bit NF4 as it loads)."""
    return train(tmp_path_factory.mktemp("chat-qlora"), "rev", "qlora")


def train(tmp: Path, task: str, method: str) -> Run:
    """`finetune run` of LoRA (or QLoRA) on ``task``'s four words, from the seeded base of initializer_range 0.1."""
    base = micro_model_dir(tmp / "base-config", initializer_range=0.1)
    instruction, answer = TASKS[task]
    rows = [{"instruction": instruction, "input": w, "output": answer(w)} for w in WORDS]
    data = write_jsonl(tmp / f"{task}.jsonl", rows)
    out = tmp / f"run-{task}"
    recipe = tiny_recipe(
        out,
        model={"path": str(base), "init": "random"},
        method=method,
        lora={"r": 8, "alpha": 16, "target_modules": "all-linear"},
        data={"train": str(data), "eval": str(data), "max_seq_len": 48},
        train={"max_steps": STEPS, "global_batch_size": 4, "micro_batch_size": 4, "lr": 5e-3},
        eval={"max_samples": 4, "max_new_tokens": 8, "batch_size": 4, "at_start": False},
    )
    # the launch() `finetune run` calls, in this process (no interpreter start); what it printed is kept
    printed = io.StringIO()
    with redirect_stdout(printed):
        code = launch(str(write_recipe(tmp / f"{task}.yaml", recipe)), [], LaunchOptions(nproc=1))
    assert code == 0, printed.getvalue()[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    em = [r["eval_exact_match"] for r in rows if "eval_exact_match" in r][-1]
    return Run(out, data, _samples(printed.getvalue()), em)


def chat(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`finetune chat ARGS` in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "finetune", "chat", *args], capture_output=True, text=True, timeout=600,
        env=clean_env(), cwd=cwd,
    )


class Terminal:
    """A command on a pseudo-terminal: what it prints is read back, lines are typed into it."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        import pty

        self.master, slave = pty.openpty()
        env = clean_env(TERM="dumb")
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                                     start_new_session=True, close_fds=True)
        os.close(slave)
        self.buffer = b""

    def expect(self, pattern: bytes, timeout: float = 300) -> str:
        """Everything printed up to and including ``pattern`` (escape sequences removed)."""
        end = time.monotonic() + timeout
        while True:
            clean = ANSI.sub(b"", self.buffer)
            found = re.search(pattern, clean)
            if found:
                self.buffer = clean[found.end():]
                return clean[: found.end()].decode(errors="replace")
            ready = select.select([self.master], [], [], 0.5)[0]
            chunk = b""
            if ready:
                with suppress(OSError):  # EIO: the child closed the terminal
                    chunk = os.read(self.master, 4096)
            self.buffer += chunk
            if (ready and not chunk) or time.monotonic() > end:
                raise AssertionError(f"no {pattern!r} in {clean.decode(errors='replace')!r}")

    def turn(self, line: str, prompt: bytes) -> list[str]:
        """Type ``line``; the lines printed before the next ``prompt``, without the echoed line."""
        os.write(self.master, line.encode() + b"\r")
        printed = self.expect(prompt).replace("\r\n", "\n").split("\n")
        assert printed[0] == line, printed
        return printed[1:-1]

    def close(self) -> int:
        code = self.proc.wait(timeout=60)
        os.close(self.master)
        return code


@pytest.mark.slow
def test_two_adapters_on_one_base_in_a_terminal(runs: dict[str, Run], tmp_path: Path) -> None:
    term = Terminal(
        [sys.executable, "-m", "finetune", "chat",
         "--adapter", f"rev={runs['rev'].out}", "--adapter", f"up={runs['up'].out}"],
        tmp_path,
    )
    banner = term.expect(rb"\nrev> ")
    assert "loaded rev, up on the base" in banner and "instruction prompt" in banner
    # a typed \n is the line break between the instruction and its input
    assert term.turn("Reverse the letters.\\nhello", b"\nrev> ") == ["olleh"]
    assert term.turn("/adapter up", b"\nup> ") == ["(adapter up)"]
    assert term.turn("Write in capitals.\\ntiny", b"\nup> ") == ["TINY"]
    assert term.turn("Reverse the letters.\\nhello", b"\nup> ") != ["olleh"]  # not rev's answer any more
    assert term.turn("/adapter", b"\nup> ") == ["  rev", "* up", "  base (adapters disabled)"]
    assert term.turn("/adapter base", b"\nbase> ") == ["(the base, adapters disabled)"]
    assert term.turn("Write in capitals.\\ntiny", b"\nbase> ") != ["TINY"]
    assert term.turn("/adapter rev", b"\nrev> ") == ["(adapter rev)"]
    assert term.turn("Reverse the letters.\\nlora", b"\nrev> ") == ["arol"]
    os.write(term.master, b"/quit\r")
    assert term.close() == 0


@pytest.mark.slow
def test_prompt_and_input_answer_as_the_runs_greedy_eval(runs: dict[str, Run], tmp_path: Path) -> None:
    rev, up = runs["rev"], runs["up"]
    assert rev.exact_match == 1.0 and up.exact_match == 1.0  # both runs learned their words
    assert [want for want, _ in rev.samples] == ["cba", "olleh", "ynit"]
    # --prompt: the run's own output.dir, the answer on stdout
    done = chat(str(rev.out), "--prompt", "Reverse the letters.\\nhello")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == rev.samples[1][1] == "olleh"
    # --input/--output: both adapters on one base, starting with `up`, over up's eval rows
    answers = tmp_path / "answers.jsonl"
    done = chat("--adapter", str(rev.out), "--adapter", str(up.out), "--use", "run-up",
                "--input", str(up.data), "--output", str(answers), "--batch-size", "3")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [r["input"] for r in rows] == WORDS
    got = [r["answer"] for r in rows]
    assert got[:3] == [generated for _, generated in up.samples]
    assert sum(r["answer"] == r["output"] for r in rows) / len(rows) == up.exact_match
    assert "exact match 100.0% of the 4 rows" in done.stderr


@pytest.mark.slow
def test_a_merged_model_answers_as_the_adapter_it_folds(runs: dict[str, Run], tmp_path: Path) -> None:
    """`finetune merge` output: a whole model, prompted as the run it came from (its merge marker names it)."""
    rev = runs["rev"]
    merged = CliRunner().invoke(app, ["merge", str(rev.out), "--out", str(tmp_path / "merged")])
    assert merged.exit_code == 0, merged.output
    answers = tmp_path / "answers.jsonl"
    code, out = invoke(str(tmp_path / "merged"), "--input", str(rev.data), "--output", str(answers))
    assert code == 0, out
    got = [json.loads(line)["answer"] for line in answers.read_text().splitlines()]
    assert got == [w[::-1] for w in WORDS]
    assert got[:3] == [generated for _, generated in rev.samples]


@pytest.mark.slow
def test_a_qlora_adapter_answers_over_its_4bit_base_as_its_eval(qlora_run: Run, tmp_path: Path) -> None:
    assert qlora_run.exact_match == 1.0
    answers = tmp_path / "answers.jsonl"
    code, out = invoke(str(qlora_run.out), "--input", str(qlora_run.data), "--output", str(answers))
    assert code == 0, out
    assert "(4-bit)" in out and "exact match 100.0% of the 4 rows" in out
    got = [json.loads(line)["answer"] for line in answers.read_text().splitlines()]
    assert got == [w[::-1] for w in WORDS]
    assert got[:3] == [generated for _, generated in qlora_run.samples]


@pytest.mark.slow
def test_adapters_of_different_bases_are_refused_before_loading(runs: dict[str, Run], tmp_path: Path) -> None:
    """A base of another shape given with a run's adapter: one sentence naming both."""
    other = saved_model(tmp_path / "other", hidden_size=128, intermediate_size=256)
    code, out = invoke(str(other), "--adapter", str(runs["rev"].out), "--prompt", "x")
    assert code == 2
    assert f"--adapter run-rev was trained on the base {runs['rev'].out / 'base'}, not on {other}" in out
    assert "their configs differ (hidden_size: 256" in out


# --------------------------------------------------------------------------------------------------
# Without training: bad input, and the generation loop
# --------------------------------------------------------------------------------------------------


def saved_model(d: Path, **config: object) -> Path:
    """A one-layer tiny Llama with seeded random weights saved as a Hugging Face model directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    micro_model_dir(d, num_hidden_layers=1, **config)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d)).save_pretrained(d)
    return d


def lora_adapter(base: Path, out: Path) -> Path:
    """A LoRA adapter (untrained) of ``base``, saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_model(tmp_path_factory.mktemp("chat-model") / "model")


def invoke(*args: str) -> tuple[int, str]:
    """`finetune chat ARGS` in this process: (exit code, what it printed)."""
    result = CliRunner().invoke(app, ["chat", *args])
    return result.exit_code, result.output


def test_a_directory_that_is_neither_run_nor_model(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    code, out = invoke(str(tmp_path), "--prompt", "hi")
    assert code == 2
    assert out.startswith(f"error: RUN_OR_MODEL {tmp_path} is neither a run nor a model directory")
    assert out.count("\n") == 1


def test_a_run_that_has_not_saved_yet(tmp_path: Path) -> None:
    (tmp_path / "recipe.yaml").write_text("method: lora\n")
    code, out = invoke("--adapter", str(tmp_path))
    assert code == 2 and "is a run directory without a trained model or adapter yet" in out


def test_an_adapter_of_another_base(model_dir: Path, tmp_path: Path) -> None:
    other = saved_model(tmp_path / "other", hidden_size=128, intermediate_size=256)
    adapter = lora_adapter(other, tmp_path / "adapter")
    code, out = invoke(str(model_dir), "--adapter", f"mine={adapter}", "--prompt", "hi")
    assert code == 2
    assert out == (
        f"error: --adapter mine was trained on the base {other}, not on {model_dir}: their configs differ "
        f"(hidden_size: 128 in {other}, 256 in {model_dir}); give adapters of one base\n"
    )


def test_a_missing_input_file(model_dir: Path, tmp_path: Path) -> None:
    answers = tmp_path / "answers.jsonl"
    code, out = invoke(str(model_dir), "--input", str(tmp_path / "prompts.jsonl"), "--output", str(answers))
    assert code == 2 and f"--input {tmp_path / 'prompts.jsonl'} does not exist" in out
    assert not answers.exists()


def test_a_malformed_line_names_file_and_line(model_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "no end\n')
    answers = tmp_path / "answers.jsonl"
    code, out = invoke(str(model_dir), "--input", str(prompts), "--output", str(answers))
    assert code == 2 and f"--input {prompts}:2: not valid JSON" in out
    assert not answers.exists()


def test_a_row_without_a_prompt_names_file_and_line(model_dir: Path, tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hi"}, {"question": "hi"}])
    answers = tmp_path / "answers.jsonl"
    code, out = invoke(str(model_dir), "--input", str(prompts), "--output", str(answers))
    assert code == 2
    # the tiny model's tokenizer has a chat template: rows are prompts or conversations
    assert f"--input {prompts}:2: expected a `prompt` string or a `messages` list" in out
    assert not answers.exists()


def test_a_prompt_longer_than_the_model_reads(model_dir: Path) -> None:
    """512 positions, 256 kept for the answer: a prompt of 300 bytes (tokens) does not fit."""
    code, out = invoke(str(model_dir), "--prompt", "x" * 300)
    assert code == 2
    assert "--prompt: the prompt is " in out and "the model reads 512 positions, 256 of them kept for the answer" in out


def test_prompt_formats_follow_the_run(model_dir: Path) -> None:
    """A directory without a recipe and a chat template: the conversation through the template; an instruction
    run: the prompt its evaluation builds, each turn alone; a text run: the raw text."""
    from finetune.inference import load_tokenizer, prompt_format
    from finetune.storage.rundir import RunDir

    tok = load_tokenizer(model_dir, model_dir, False)
    chat = prompt_format(RunDir(model_dir, "model", "m"), tok)
    history = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}]
    assert chat.kind == "chat" and tok.decode(chat.turn("xy", history, "Be brief.")) == (
        "System: Be brief.\nUser: abc\nAssistant: cba</s>\nUser: xy\nAssistant: "
    )
    instruction = prompt_format(RunDir(model_dir, "model", "m", recipe={"data": {"format": "instruction"}}), tok)
    assert tok.decode(instruction.turn("Reverse the letters.\nabc", history, "Be brief.")) == (
        "Reverse the letters.\nabc\nAnswer: "
    )
    row = {"instruction": "Reverse the letters.", "input": "abc", "output": "cba"}
    assert instruction.row(row, "f:1", None) == (instruction.turn("Reverse the letters.\nabc", [], None), "cba")
    text = prompt_format(RunDir(model_dir, "model", "m", recipe={"data": {"format": "text"}}), tok)
    assert tok.decode(text.turn("abc", history, None)) == "abc"


def test_commands_in_a_session_without_a_terminal(model_dir: Path) -> None:
    """Lines from a pipe: a turn, /system, /reset, /adapter on a whole model, an unknown command, /quit."""
    result = CliRunner().invoke(
        app, ["chat", str(model_dir), "--max-new-tokens", "2"],
        input="hi\n/system Be brief.\n/reset\n/adapter\n/nope\n/quit\nnever read\n",
    )
    assert result.exit_code == 0, result.output
    replies = [line for line in result.stdout.splitlines() if line.startswith("> (")]
    assert replies == [
        "> (system prompt set)",
        "> (the conversation is forgotten)",
        "> (no adapters: this is a whole model; pass --adapter DIR to load adapters onto a base)",
        "> (unknown command /nope; /help lists them)",
    ]


def test_streaming_and_sampling_leave_the_greedy_answer_as_evaluation_computes_it(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from finetune.model.generation import greedy_tokens, left_padded, sampler

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids, mask = left_padded([[1, 70, 71, 72], [1, 80]], pad_id=0)
    evaluation = greedy_tokens(model, ids, mask, 6, nullcontext)
    seen: list[list[int]] = []
    def record(step: torch.Tensor) -> bool:
        seen.append(step[:, 0].tolist())
        return False

    streamed = greedy_tokens(model, ids, mask, 6, nullcontext, pick=sampler(0.0, 1.0, torch.Generator()), on_step=record)
    assert torch.equal(evaluation, streamed)
    assert [list(col) for col in zip(*seen, strict=True)] == evaluation.tolist()
    stopped = greedy_tokens(model, ids, mask, 6, nullcontext,
                            on_step=lambda t: True)
    assert torch.equal(stopped, evaluation[:, :1])


def test_top_p_keeps_the_smallest_set_of_likely_tokens() -> None:
    from finetune.model.generation import sampler

    logits = torch.log(torch.tensor([[0.05, 0.6, 0.3, 0.05]]))
    pick = sampler(1.0, 0.5, torch.Generator().manual_seed(0))
    assert pick is not None and {int(pick(logits)) for _ in range(50)} == {1}  # 0.6 alone reaches 0.5
    pick = sampler(1.0, 0.8, torch.Generator().manual_seed(0))
    assert {int(pick(logits)) for _ in range(200)} == {1, 2}  # 0.6 + 0.3
    assert sampler(0.0, 0.5, torch.Generator()) is None  # temperature 0: the argmax
