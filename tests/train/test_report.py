"""``finetune report``: the PNG and HTML of a real run, drawn from exactly its metrics.jsonl and plan."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app
from finetune.commands.report import PANELS, build_figure, load_run
from finetune.commands.run import LaunchOptions, launch
from tests.support import tiny_recipe, write_recipe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    out = tmp / "run-a"
    recipe = tiny_recipe(
        out, train={"max_steps": 6}, eval={"every": 3, "max_samples": 8, "max_new_tokens": 4, "batch_size": 8}
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # rich's console writes to the sys.stdout of the moment
        assert launch(str(write_recipe(tmp / "a.yaml", recipe)), [], LaunchOptions(measure_memory=True)) == 0
    (tmp / "stdout.txt").write_text(printed.getvalue())
    return out


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_figure_draws_metrics_and_memory(run_dir: Path) -> None:
    rows = _rows(run_dir)
    fig = build_figure([load_run(run_dir)])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert tuple(axes) == PANELS

    def line(title: str, label: str | None = None) -> tuple[list, list]:
        lines = [ln for ln in axes[title].lines if label is None or ln.get_label() == label]
        return list(lines[0].get_xdata()), list(lines[0].get_ydata())

    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    assert [s for s, _ in evals] == [0, 3, 6]
    assert line("loss", "train") == ([s for s, _ in train], [v for _, v in train])
    assert line("loss", "eval") == ([s for s, _ in evals], [v for _, v in evals])
    assert line("learning rate") == (
        [r["step"] for r in rows if "lr" in r],
        [r["lr"] for r in rows if "lr" in r],
    )
    assert line("tokens/s")[1] == [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    assert line("eval exact match")[1] == [
        100 * r["eval_exact_match"] for r in rows if "eval_exact_match" in r
    ]

    # Memory: the stacked bar is the plan's breakdown, the grey one the measured peak of memory.json.
    plan = json.loads((run_dir / "plan.json").read_text())["chosen"]["memory"]
    measured = json.loads((run_dir / "memory.json").read_text())["measured_peak"]
    bars = axes["memory per process (MiB)"].patches
    plan_bars = [b for b in bars if b.get_x() < 0.5]
    assert sum(b.get_height() for b in plan_bars) == pytest.approx(plan["total"] / 2**20)
    assert [b.get_height() for b in bars if b.get_x() > 0.5] == [pytest.approx(measured / 2**20)]


def test_cli_png_html_and_overlay(run_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["report", str(run_dir)])
    assert res.exit_code == 0, res.output
    png = (run_dir / "report.png").read_bytes()
    assert _png_size(png) == (1400, 850)  # figsize 14 x 8.5 in at 100 dpi
    assert 30_000 < len(png) < 1_000_000

    # A second run (a copy with a different loss curve) overlays: one train-loss line per run.
    other = tmp_path / "run-b"
    shutil.copytree(run_dir, other)
    rows = _rows(run_dir)
    (other / "metrics.jsonl").write_text(
        "".join(json.dumps({**r, **({"loss": r["loss"] / 2} if "loss" in r else {})}) + "\n" for r in rows)
    )
    fig = build_figure([load_run(run_dir), load_run(other)])
    loss_ax = next(ax for ax in fig.axes if ax.get_title() == "loss")
    labels = [ln.get_label() for ln in loss_ax.lines]
    assert labels == ["run-a train", "run-a eval", "run-b train", "run-b eval"]
    assert list(loss_ax.lines[2].get_ydata()) == [r["loss"] / 2 for r in rows if "loss" in r]

    page = tmp_path / "both.html"
    res = runner.invoke(app, ["report", str(run_dir), str(other), "--out", str(page)])
    assert res.exit_code == 0, res.output
    text = page.read_text()
    assert "src='http" not in text and "<script" not in text  # self-contained
    img = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text).group(1))
    assert _png_size(img) == (1400, 850)
    assert text.count("<h3>recipe</h3>") == 2 and "micro_batch_size" in text and "measured peak" in text

    res = runner.invoke(app, ["report", str(tmp_path / "nowhere")])
    assert res.exit_code == 2
    assert "has no metrics.jsonl; give the output.dir of a `finetune run`" in res.output


def test_run_prints_the_report_command(run_dir: Path) -> None:
    out = (run_dir.parent / "stdout.txt").read_text()
    assert f"plots: finetune report {run_dir} (--out report.html" in out
    assert f"next: finetune chat {run_dir} (talk to it), finetune eval {run_dir} --tasks run --baseline" in out
