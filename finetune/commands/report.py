"""``finetune report RUN_DIR [RUN_DIR...]``: a run's curves and memory, as one PNG or a self-contained HTML page.

Reads only what a run leaves in its output.dir (metrics.jsonl, plan.json, recipe.yaml, memory.json), so it works
on a finished, stopped or still running run, and on a copy of one. Several run directories overlay their curves.
matplotlib draws with its Agg backend (no display needed).
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The panels of the figure, in order (a test finds the axes by these titles).
PANELS = ("loss", "eval exact match", "learning rate", "tokens/s", "memory per process (MiB)")
#: The sixth panel, drawn when a run measured a retain set (eval.retain): its loss, beside the task's curves.
RETAIN_PANEL = "retain loss (forgetting)"
#: A third row of panels, drawn when a run logged preference figures (train.objective dpo, simpo, orpo:
#: metrics.jsonl's ``rewards/*`` columns and their ``eval_`` versions): each as train and eval curves.
PREFERENCE_PANELS = ("reward accuracy", "reward margin", "chosen and rejected rewards")
#: The metrics.jsonl columns whose presence (train or eval) draws :data:`PREFERENCE_PANELS`.
PREFERENCE_COLUMNS = ("rewards/accuracy", "rewards/margin", "rewards/chosen", "rewards/rejected")

#: A row of panels drawn when a run trained a mixture of experts (metrics.jsonl's ``aux_loss`` and
#: ``expert_load`` columns, finetune/model/router.py): its load-balancing loss and how unevenly its experts are loaded.
MOE_PANELS = ("load-balancing loss", "expert load (busiest / mean expert)")
MOE_COLUMNS = ("aux_loss", "expert_load")

#: A row of panels drawn when a run trained with grpo (metrics.jsonl's ``reward``, ``reward_std``, ``kl``,
#: ``completion_length`` and the evaluations' ``eval_reward``): the reward of the sampled completions with its
#: standard deviation as a band, and the greedy answers' eval_reward; the KL to the reference; the completions' length.
GRPO_PANELS = ("reward (sampled, and eval_reward)", "KL to the reference", "completion length (tokens)")
GRPO_COLUMNS = ("reward", "reward_std", "kl", "completion_length", "eval_reward")

#: The plan's memory categories, bottom to top of the stacked bar.
CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers", "overhead", "rollout")


@dataclass
class RunData:
    """What a run directory holds, as read by :func:`load_run`."""

    path: Path
    rows: list[dict[str, Any]]
    recipe_text: str = ""
    plan: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The label of this run in legends: its directory's name."""
        return self.path.name

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` over the rows that have it."""
        pts = [(int(r["step"]), float(r[key])) for r in self.rows if r.get(key) is not None]
        return [s for s, _ in pts], [v for _, v in pts]

    @property
    def preference(self) -> bool:
        """Whether the run logged preference figures (train or eval ``rewards/*`` columns)."""
        keys = {*PREFERENCE_COLUMNS, *(f"eval_{k}" for k in PREFERENCE_COLUMNS)}
        return any(k in keys for r in self.rows for k in r)

    @property
    def grpo(self) -> bool:
        """Whether the run logged grpo's figures (``reward``, ``eval_reward``, ...)."""
        return any(k in GRPO_COLUMNS for r in self.rows for k in r)

    @property
    def moe(self) -> bool:
        """Whether the run logged a mixture of experts' figures (``aux_loss``, ``expert_load``)."""
        return any(k in MOE_COLUMNS for r in self.rows for k in r)


def load_run(run_dir: str | Path) -> RunData:
    """What ``run_dir`` holds, as the run reader reads a run's output.dir at any point
    (:func:`finetune.storage.rundir.read_outputs`): metrics.jsonl (required), and recipe.yaml, plan.json,
    memory.json when there."""
    from finetune.storage.rundir import read_outputs

    run = read_outputs(str(run_dir), "RUN_DIR")
    return RunData(Path(run_dir), run.metrics(), run.recipe_text, run.plan or {}, run.memory)


def build_figure(runs: list[RunData]) -> Figure:
    """The report's figure: one panel per entry of :data:`PANELS`, every run overlaid, a row of
    :data:`PREFERENCE_PANELS` when a run logged preference figures, one of :data:`GRPO_PANELS` when a run trained
    with grpo, and one of :data:`MOE_PANELS` when a run trained a mixture of experts.

    Built with matplotlib's object API (no pyplot state), so tests can read each line's data back.
    """
    from matplotlib.figure import Figure

    preference = any(run.preference for run in runs)
    grpo = any(run.grpo for run in runs)
    moe = any(run.moe for run in runs)
    rows = 2 + preference + grpo + moe
    fig = Figure(figsize=(14, 4.25 * rows), layout="constrained")
    axes = fig.subplots(rows, 3).ravel()
    ax_loss, ax_em, ax_lr, ax_tps, ax_mem, ax_spare = axes[:6]
    for ax, title in zip(axes, PANELS, strict=False):
        ax.set_title(title)
    colors = [f"C{i}" for i in range(10)]
    for i, run in enumerate(runs):
        c, label = colors[i % 10], run.name if len(runs) > 1 else None
        x, y = run.series("loss")
        ax_loss.plot(x, y, color=c, lw=1.2, label=f"{run.name} train" if label else "train")
        x, y = run.series("eval_loss")
        if x:
            ax_loss.plot(
                x,
                y,
                color=c,
                lw=1.2,
                ls="--",
                marker="o",
                ms=4,
                label=f"{run.name} eval" if label else "eval",
            )
        x, y = run.series("eval_exact_match")
        if x:
            ax_em.plot(x, [100 * v for v in y], color=c, marker="o", ms=4, label=label)
        x, y = run.series("retain_exact_match")
        if x:
            ax_em.plot(x, [100 * v for v in y], color=c, ls="--", marker="s", ms=4,
                       label=f"{run.name} retain" if label else "retain")
        x, y = run.series("retain_loss")
        if x:
            ax_spare.plot(x, y, color=c, marker="s", ms=4, label=run.name if label else "retain")
        x, y = run.series("lr")
        ax_lr.plot(x, y, color=c, label=label)
        x, y = run.series("tokens_per_s")
        ax_tps.plot(x, y, color=c, label=label)
    if ax_spare.lines:
        ax_spare.set_title(RETAIN_PANEL)
    else:
        ax_spare.set_axis_off()
    for ax in (ax_loss, ax_em, ax_lr, ax_tps, ax_spare):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        labelled = [ln for ln in ax.lines if not str(ln.get_label()).startswith("_")]
        if labelled and (len(runs) > 1 or ax in (ax_loss, ax_em, ax_spare)):
            ax.legend(fontsize=8)
    ax_em.set_ylabel("%")
    _memory_panel(ax_mem, runs)
    row = 6  # the first axis of the next extra row
    if preference:
        _preference_panels(axes[row : row + 3], runs)
        row += 3
    if grpo:
        _grpo_panels(axes[row : row + 3], runs)
        row += 3
    if moe:
        _moe_panels(axes[row : row + 3], runs)
    return fig


def _grpo_panels(axes: Sequence[Any], runs: list[RunData]) -> None:
    """grpo's figures of each run per step: the mean reward of the sampled completions (solid) inside a band of
    one standard deviation (``reward_std``), the evaluations' ``eval_reward`` of the greedy answers (dashed with
    markers); the KL to the reference (``kl``); the mean completion length in tokens."""
    ax_reward, ax_kl, ax_length = axes
    for ax, title in zip(axes, GRPO_PANELS, strict=True):
        ax.set_title(title)
    several = len(runs) > 1
    for i, run in enumerate(runs):
        c, name = f"C{i % 10}", f"{run.name} " if several else ""
        x, y = run.series("reward")
        if x:
            ax_reward.plot(x, y, color=c, lw=1.2, label=f"{name}train")
            spread = dict(zip(*run.series("reward_std"), strict=True))
            if all(s in spread for s in x):
                ax_reward.fill_between(
                    x, [v - spread[s] for s, v in zip(x, y, strict=True)],
                    [v + spread[s] for s, v in zip(x, y, strict=True)], color=c, alpha=0.15, lw=0,
                    label=f"{name}train ± std",
                )
        x, y = run.series("eval_reward")
        if x:
            ax_reward.plot(x, y, color=c, lw=1.2, ls="--", marker="o", ms=4, label=f"{name}eval")
        for ax, key in ((ax_kl, "kl"), (ax_length, "completion_length")):
            x, y = run.series(key)
            if x:
                ax.plot(x, y, color=c, lw=1.2, label=run.name if several else None)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax is ax_reward or (several and ax.lines):
            ax.legend(fontsize=8)


def _moe_panels(axes: Sequence[Any], runs: list[RunData]) -> None:
    """A mixture of experts' load-balancing loss (without its coefficient: top-k when the router spreads tokens
    evenly) and its experts' load (the busiest expert's tokens over the mean expert's; 1.0: even) per step."""
    ax_aux, ax_load, ax_off = axes[:3]
    ax_off.set_axis_off()
    for ax, title in zip((ax_aux, ax_load), MOE_PANELS, strict=True):
        ax.set_title(title)
    for i, run in enumerate(runs):
        label = run.name if len(runs) > 1 else None
        for ax, key in ((ax_aux, "aux_loss"), (ax_load, "expert_load")):
            x, y = run.series(key)
            if x:
                ax.plot(x, y, color=f"C{i % 10}", lw=1.2, label=label)
    ax_load.axhline(1.0, color="0.6", lw=0.8, ls=":")  # an even load
    for ax in (ax_aux, ax_load):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(runs) > 1 and ax.lines:
            ax.legend(fontsize=8)


def _preference_panels(axes: Sequence[Any], runs: list[RunData]) -> None:
    """The reward accuracy (%), the reward margin and the chosen and rejected rewards of each run: the
    training steps' figures as solid lines, the evaluations' (``eval_`` columns) dashed with markers."""
    ax_acc, ax_margin, ax_rewards = axes
    for ax, title in zip(axes, PREFERENCE_PANELS, strict=True):
        ax.set_title(title)
    several = len(runs) > 1
    for i, run in enumerate(runs):
        c = f"C{i % 10}"
        curves = [
            (ax_acc, "rewards/accuracy", "", 100.0, c),
            (ax_margin, "rewards/margin", "", 1.0, c),
            (ax_rewards, "rewards/chosen", "chosen", 1.0, "C2" if not several else c),
            (ax_rewards, "rewards/rejected", "rejected", 1.0, "C3" if not several else c),
        ]
        for ax, key, what, scale, color in curves:
            eval_style = {"ls": "--", "marker": "o", "ms": 4}
            for phase, column, style in (("train", key, {}), ("eval", f"eval_{key}", eval_style)):
                x, y = run.series(column)
                if not x:
                    continue
                label = " ".join(p for p in ((run.name if several else ""), phase, what) if p)
                if what == "rejected" and several:
                    style = {**style, "alpha": 0.5}
                ax.plot(x, [scale * v for v in y], color=color, lw=1.2, label=label, **style)
    ax_acc.set_ylabel("%")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)


def _memory_panel(ax: Any, runs: list[RunData]) -> None:
    """Per run: the plan's breakdown as a stacked bar, the measured peak beside it (memory.json, when measured)."""
    mib = 2**20
    labels, xs = [], []
    for i, run in enumerate(runs):
        pred = run.plan.get("chosen", {}).get("memory", {})
        base = 0.0
        for j, cat in enumerate(CATEGORIES):
            v = pred.get(cat, 0) / mib
            if v:
                ax.bar(2 * i, v, bottom=base, color=f"C{j}", label=cat if i == 0 else None, width=0.8)
                base += v
        labels.append(f"{run.name}\nplan" if len(runs) > 1 else "plan")
        xs.append(2 * i)
        measured = run.memory.get("measured_peak")
        if measured:
            ax.bar(
                2 * i + 1, measured / mib, color="0.35", width=0.8, label="measured peak" if i == 0 else None
            )
            labels.append(f"{run.name}\nmeasured" if len(runs) > 1 else "measured")
            xs.append(2 * i + 1)
    ax.set_xticks(xs, labels, fontsize=8)
    if ax.patches:
        ax.legend(fontsize=8)


def png_bytes(fig: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG bytes (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def html_page(runs: list[RunData], png: bytes) -> str:
    """A self-contained page: the figure as a base64 PNG, then each run's final metrics, plan and recipe."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>finetune report</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}th{background:#eee}"
        "pre{background:#f6f6f6;padding:1em}</style></head><body>",
        f"<h1>finetune report: {html.escape(', '.join(r.name for r in runs))}</h1>",
        f"<img alt='curves' src='data:image/png;base64,{base64.b64encode(png).decode()}'>",
    ]
    for run in runs:
        parts.append(f"<h2>{html.escape(run.name)}</h2><p>{html.escape(str(run.path.resolve()))}</p>")
        last = {k: v for r in run.rows for k, v in r.items()}
        parts.append(_table("last logged values", [(k, _fmt(v)) for k, v in last.items()]))
        chosen = run.plan.get("chosen", {})
        if chosen:
            rows = [(k, _fmt(v)) for k, v in chosen.items() if k != "memory"]
            rows += [(f"memory.{k}", f"{v / 2**20:,.1f} MiB") for k, v in chosen.get("memory", {}).items()]
            if run.memory.get("measured_peak"):
                rows.append(("measured peak", f"{run.memory['measured_peak'] / 2**20:,.1f} MiB"))
            parts.append(_table("plan", rows))
        moe = run.plan.get("model", {}).get("moe")
        if moe:
            model = run.plan["model"]
            rows = [(k.replace("_", " "), _fmt(v)) for k, v in moe.items()]
            rows += [("expert weights", f"{100 * model.get('expert_fraction', 0):.1f}% of the weights"),
                     ("active parameters per token", f"{model.get('active_parameters', 0):,}"),
                     ("load-balancing loss coefficient", _fmt(model.get("aux_loss_coef", 0.0)))]
            parts.append(_table("mixture of experts", rows))
        if run.recipe_text:
            parts.append(f"<h3>recipe</h3><pre>{html.escape(run.recipe_text)}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _table(title: str, rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<h3>{html.escape(title)}</h3><table>{body}</table>"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def write_report(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Draw ``run_dirs`` into ``out`` (``.png`` or ``.html``; default: report.png in the only run's directory,
    else in the current directory) and return its path."""
    if not run_dirs:
        raise UserError("RUN_DIR: give at least one run directory (an output.dir of `finetune run`)")
    runs = [load_run(d) for d in run_dirs]
    target = Path(out) if out else (runs[0].path / "report.png" if len(runs) == 1 else Path("report.png"))
    if target.suffix.lower() not in (".png", ".html"):
        raise UserError(f"--out: {target} must end in .png or .html")
    fig = build_figure(runs)
    png = png_bytes(fig)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.suffix.lower() == ".png":
        target.write_bytes(png)
    else:
        target.write_text(html_page(runs, png))
    return target
