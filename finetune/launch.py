"""Start a run: validate the recipe, make the Plan, then train in this process or launch N of them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune.errors import UserError
from finetune.recipe import LoadedRecipe, RecipeError, check_files, load_recipe, recipe_to_yaml


def prepare(recipe: str, overrides: list[str]) -> LoadedRecipe:
    """Load and check the recipe; make its input paths absolute so the saved copy is self-describing."""
    loaded = load_recipe(recipe, overrides)
    problems = check_files(loaded)
    if problems:
        raise RecipeError(problems)
    r = loaded.recipe
    mp = loaded.resolve_input(r.model.path)
    if mp.exists():
        r.model.path = str(mp.resolve())
    if isinstance(r.data.train, list):
        r.data.train = [_abs_data(loaded, t) for t in r.data.train]
    else:
        r.data.train = _abs_data(loaded, r.data.train)
    if r.data.eval:
        r.data.eval = _abs_data(loaded, r.data.eval)
    return loaded


def _abs_data(loaded: LoadedRecipe, spec: str) -> str:
    if any(ch in spec for ch in "*?["):
        return str(loaded.base_dir / spec) if not Path(spec).is_absolute() else spec
    p = loaded.resolve_input(spec)
    return str(p.resolve()) if p.exists() else spec


def write_run_files(loaded: LoadedRecipe, plan_dict: dict) -> Path:
    """Save the resolved recipe and the plan in the output directory (rank 0, before training)."""
    out = Path(loaded.recipe.output.dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"output.dir: cannot create {out} ({exc.strerror}); choose a writable directory") from None
    if not os.access(out, os.W_OK):
        raise UserError(f"output.dir: {out} is not writable; choose a writable directory")
    (out / "recipe.yaml").write_text(recipe_to_yaml(loaded.recipe))
    (out / "plan.json").write_text(json.dumps(plan_dict, indent=2) + "\n")
    return out


def launch(
    recipe: str,
    *,
    overrides: list[str],
    nproc: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    resume: str | None = None,
    measure_memory: bool = False,
) -> int:
    """Run ``recipe``: plan, then train in-process (1 process) or through torch.distributed.run (N)."""
    import torch

    from finetune.plan.flowchart import plan_for_run

    loaded = prepare(recipe, overrides)
    r = loaded.recipe
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if nproc is None:
        nproc = r.distributed.nproc if r.distributed.nproc != "auto" else max(1, torch.cuda.device_count())
    plan = plan_for_run(loaded, nproc=nproc, nnodes=nnodes, device=device)
    write_run_files(loaded, plan.to_dict())
    if nproc * nnodes == 1:
        from finetune.train.loop import train_rank

        train_rank(loaded, plan, measure_memory=measure_memory)
        return 0
    raise UserError("multi-process runs are not available yet")
