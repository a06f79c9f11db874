"""README.md's commands run as written, so the README cannot drift from the tool.

Every line of a ```bash block is a command. The install and test commands (``pip``, ``pytest``) are what the
environment running this suite already did, the several-node lines (``--nnodes``) need several launchers
(tests/distributed/test_nodes.py runs two on one host), and ``finetune serve`` serves until stopped
(tests/e2e/test_serve.py); every other command runs here, in a temporary directory holding a
link to the shipped ``recipes/`` (the README's commands run from the repository's root, and write ``runs/`` and
``models/`` into the current directory). Trainings get a few more ``--set`` overrides so that they take two
steps. The plan's table printed in the README is compared with the top of what ``finetune plan`` prints.

The commands run through the CLI's own app in this process, with the argv ``finetune`` gives it (no interpreter
start per command); a run of several processes (``--nproc``) runs as ``finetune`` in its own process, its
launcher starting the workers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

#: What makes a README training short: two steps, a small evaluation at the end only.
SHORT_RUN = [
    "--set", "train.max_steps=2",
    "--set", "eval.at_start=false",
    "--set", "eval.max_samples=4",
    "--set", "eval.max_new_tokens=2",
]  # fmt: skip


def fenced_blocks(text: str, language: str) -> list[str]:
    """The contents of the ```language blocks of a Markdown text, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.S | re.M)


def readme_commands() -> list[list[str]]:
    """Every command of README.md's bash blocks, as argv (comments stripped), in order."""
    commands = []
    for block in fenced_blocks(README.read_text(), "bash"):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                commands.append(argv)
    return commands


def skipped(argv: list[str]) -> bool:
    """Install and test commands, one node's half of a several-node run, and the server, which runs until it is
    stopped (tests/e2e/test_serve.py starts it and asks it through OpenAI's client)."""
    return argv[0] in ("pip", "pytest") or "--nnodes" in argv or argv[1:2] == ["serve"]


#: The commands that need an optional extra: verb -> (the module it imports, the extra that installs it).
EXTRAS = {"export": ("gguf", "export"), "eval": ("lm_eval", "eval")}


def missing_extra(argv: list[str]) -> str | None:
    """Why ``argv`` cannot run in this environment (its verb's extra is not installed), or None."""
    module, extra = EXTRAS.get(argv[1], (None, None)) if argv[0] == "finetune" else (None, None)
    if module is None or find_spec(module) is not None:
        return None
    return f"`{shlex.join(argv[:2])}` needs the {extra} extra (pip install -e '.[{extra}]')"


def workdir(tmp_path: Path) -> Path:
    """A directory like the repository's root for the README's commands: ``recipes`` and nothing else."""
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    return tmp_path


def test_the_readme_has_the_commands_a_newcomer_needs() -> None:
    commands = readme_commands()
    verbs = [argv[1] for argv in commands if argv[0] == "finetune"]
    assert {"run", "plan", "merge", "validate", "recipes", "report"} <= set(verbs), verbs
    assert ["pytest"] in commands and ["pytest", "-m", "slow or dist or memory or gpu"] in commands
    assert all(argv[0] in ("finetune", "pip", "pytest") for argv in commands), commands
    # The test tiers README gives are the ones CI runs.
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^check \d+ pytest$", ci, re.M) and re.search(r'check \d+ pytest -m "slow or dist or memory or gpu"', ci)
    # Every recipe a command names is shipped.
    named = {a for argv in commands for a in argv if a.startswith("recipes/") and a.endswith(".yaml")}
    assert named and all((ROOT / name).is_file() for name in named), named


def test_validate_and_recipes_commands_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The install-free commands that load nothing: in-process, through the CLI's own app."""
    from typer.testing import CliRunner

    from finetune.cli import app

    monkeypatch.chdir(workdir(tmp_path))
    ran = []
    for argv in readme_commands():
        if argv[0] == "finetune" and argv[1] in ("validate", "recipes"):
            result = CliRunner().invoke(app, argv[1:])
            assert result.exit_code == 0, (argv, result.output)
            ran.append(argv[1:])
    assert ["validate", "recipes/quickstart.yaml"] in ran and ["recipes", "ls"] in ran, ran
    assert "quickstart" in CliRunner().invoke(app, ["recipes", "ls"]).output
    copied = [argv[-1] for argv in ran if argv[:2] == ["recipes", "cp"]]
    assert copied and all((tmp_path / name).is_file() for name in copied), copied
    assert (tmp_path / copied[0]).read_text() == (ROOT / "recipes" / "quickstart.yaml").read_text()


def printed_plan() -> tuple[list[str], str]:
    """The top of the plan README prints in its first ```text block (the table), and its command."""
    text = README.read_text()
    table = fenced_blocks(text, "text")[0]
    command = re.search(r"\(`(finetune plan [^`]+)`\):\n\n```text", text)
    assert command, "README's first plan has no command before it"
    return table.splitlines(), command.group(1)


def finetune(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """`finetune ARGS` in ``cwd``: (exit status, stdout, stderr). Through the CLI's own app in this process, with
    the argv rewriting of its entry point; a several-process run (``--nproc``) as its own process."""
    if args[0] == "run" and "--nproc" in args:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "finetune", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
        )
        return proc.returncode, proc.stdout, proc.stderr
    from typer.testing import CliRunner

    from finetune.cli import app, bare_resume

    here = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, bare_resume(args))
    finally:
        os.chdir(here)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.slow
@pytest.mark.dist
def test_every_readme_command_runs_in_order(tmp_path: Path) -> None:
    """Every command, in the README's order (the quickstart's run is the base of the LoRA run that merge
    folds), each exiting 0; the plan's output equals the README's copy of it. A command whose extra is not
    installed (README's install is `.[test]`) is left out, and the test then says which, as its skip reason,
    once every other command has run and been checked."""
    cwd = workdir(tmp_path)
    printed, plan_command = printed_plan()
    outputs: dict[str, str] = {}
    not_run: list[str] = []
    for argv in readme_commands():
        if skipped(argv):
            continue
        reason = missing_extra(argv)
        if reason is not None:
            not_run.append(reason)
            continue
        assert argv[0] == "finetune", argv
        args = [*argv[1:], *SHORT_RUN] if argv[1] == "run" else argv[1:]
        code, stdout, stderr = finetune(args, cwd)
        assert code == 0, (argv, stdout[-3000:], stderr[-3000:])
        outputs[shlex.join(argv)] = stdout

    assert plan_command in outputs, f"README shows the output of {plan_command!r} but never runs it"
    assert outputs[plan_command].splitlines()[: len(printed)] == printed, (
        f"README's plan is not what `{plan_command}` prints: paste its output again"
    )
    as_json = next(out for cmd, out in outputs.items() if cmd.startswith("finetune plan") and "--json" in cmd)
    assert json.loads(as_json)["chosen"]
    assert (cwd / "runs" / "quickstart" / "report.png").is_file()
    merged = cwd / "models" / "merged"
    assert (merged / "config.json").is_file() and list(merged.glob("*.safetensors"))
    assert not (merged / "adapter_config.json").exists()
    if not_run:
        pytest.skip(f"every other README command ran and passed; not run: {'; '.join(not_run)}")
