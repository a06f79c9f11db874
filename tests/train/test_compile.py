"""train.compile: torch.compile per decoder block trains like eager."""

from __future__ import annotations

import json
import subprocess

import pytest

from finetune.commands.run import LaunchOptions, launch
from tests.support import tiny_recipe, write_recipe

STEPS = 4  # several optimizer updates through the compiled blocks (each new sequence length may recompile)


@pytest.mark.slow
def test_compiled_blocks_match_eager_step_by_step(tmp_path, finetune_cmd):
    """STEPS steps of the tiny model, fp32 on CPU, with and without train.compile: every step's loss within 1e-4."""
    losses = {}
    for compiled in (False, True):
        out = tmp_path / f"c{int(compiled)}"
        recipe = tiny_recipe(
            out, train={"max_steps": STEPS, "compile": compiled, "micro_batch_size": 8}, eval={"at_start": False}
        )
        recipe["data"].pop("eval")
        path = write_recipe(tmp_path / f"c{int(compiled)}.yaml", recipe)
        if compiled:  # through the CLI, in its own process (torch.compile's state stays there)
            proc = subprocess.run([*finetune_cmd, "run", str(path)], capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:  # the eager reference: the launch() the CLI calls, in this process (no interpreter start)
            assert launch(str(path), [], LaunchOptions(nproc=1)) == 0
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses[compiled] = [r["loss"] for r in rows if "loss" in r]
    assert len(losses[True]) == len(losses[False]) == STEPS
    for eager, comp in zip(losses[False], losses[True], strict=True):
        assert comp == pytest.approx(eager, abs=1e-4)
