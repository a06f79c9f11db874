"""The configuration matrix: every cell trains or is refused by `finetune validate`, none crashes.

The sweep itself is scripts/sweep_matrix.py (loaded here by path). The end-to-end tests run its FIXED list of
most-used cells, less those another test of the slow tiers trains through the CLI's own path with stronger
assertions (TRAINED_ELSEWHERE names the test), and a small seeded sample of the whole matrix; the sample's seed
is FINETUNE_SWEEP_SEED, else the date (so the sample changes from day to day), and is printed to reproduce a
failure with `python scripts/sweep_matrix.py --sample 2 --seed SEED`. `python scripts/sweep_matrix.py
--only-fixed` (or `--all`) sweeps every FIXED cell (or the whole matrix) outside the suite.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_SIZE = 2

#: FIXED cells that a test of the slow tiers already trains (the same method, strategy, tensor parallelism,
#: optimizer, precision and attention; a Llama of the tiny family), asserting loss parity or more: the
#: end-to-end test of the fixed cells leaves them out.
TRAINED_ELSEWHERE: dict[str, str] = {
    "full/single/tp1/adamw/fp32/sdpa": "tests/e2e/test_readme.py::test_every_readme_command_runs_in_order",
    "full/fsdp/tp1/adamw/fp32/sdpa": "tests/distributed/test_distributed.py::test_full_finetune_parity_with_single_process",
    "qlora4/single/tp1/adamw/fp32/sdpa": "tests/distributed/test_distributed.py::test_qlora_parity",
    "qlora4/fsdp/tp1/adamw/fp32/sdpa": "tests/distributed/test_distributed.py::test_qlora_parity",
    "full/zero2/tp1/adamw8bit/fp32/sdpa": (
        "tests/distributed/test_optimizer_sharded.py::test_eight_bit_adamw_on_shards_matches_one_process"
    ),
    "prefix/single/tp1/adamw/fp32/sdpa": "tests/distributed/test_distributed.py::test_prefix_and_bottleneck_adapter_parity",
    "adapter/ddp/tp1/adamw/fp32/sdpa": "tests/distributed/test_distributed.py::test_prefix_and_bottleneck_adapter_parity",
}


def _load_sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sweep_matrix", ROOT / "scripts" / "sweep_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


sweep_matrix = _load_sweep()


def sweep_seed() -> int:
    """FINETUNE_SWEEP_SEED, else today's date as YYYYMMDD."""
    value = os.environ.get("FINETUNE_SWEEP_SEED")
    return int(value) if value else int(dt.date.today().strftime("%Y%m%d"))


def _check(results: list, what: str) -> None:
    for r in results:
        print(f"{r.status:<12} {r.seconds:5.0f}s  {r.cell.name}  {r.detail}")
    bad = sweep_matrix.failures(results)
    assert not bad, f"{what}: cells that crashed or were refused late:\n{sweep_matrix.failure_report(results)}"


# -- the sweep's own pieces (fast) ---------------------------------------------------------------------------


def test_cell_names_round_trip() -> None:
    cells = sweep_matrix.all_cells()
    assert len(cells) == len(set(cells)) == 13 * 5 * 2 * 3 * 4 * 2 * 3 * 2 * 2
    for cell in [*sweep_matrix.FIXED, *sweep_matrix.sample_cells(50, 0)]:
        assert sweep_matrix.parse_cell(cell.name) == cell
    with pytest.raises(ValueError, match="precision `fp8`"):
        sweep_matrix.parse_cell("full/single/tp1/adamw/fp8/sdpa")
    with pytest.raises(ValueError, match="flag `fast`"):
        sweep_matrix.parse_cell("full/single/tp1/adamw/fp32/sdpa+fast")


def test_sample_is_seeded_and_without_replacement() -> None:
    a = sweep_matrix.sample_cells(30, 7)
    assert a == sweep_matrix.sample_cells(30, 7) and len(set(a)) == 30
    assert a != sweep_matrix.sample_cells(30, 8)
    fixed = set(sweep_matrix.FIXED)
    assert not fixed & set(sweep_matrix.sample_cells(200, 1, exclude=fixed))


def test_cells_trained_elsewhere_are_fixed_cells_of_a_test_that_exists() -> None:
    fixed = {c.name for c in sweep_matrix.FIXED}
    assert set(TRAINED_ELSEWHERE) < fixed, set(TRAINED_ELSEWHERE) - fixed
    for where in TRAINED_ELSEWHERE.values():
        path, name = where.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), where


def test_recipes_are_valid(tmp_path: Path) -> None:
    from finetune.recipe.schema import recipe_from_dict

    for cell in sweep_matrix.FIXED:
        r = recipe_from_dict(sweep_matrix.recipe_for(cell, tmp_path / "out", with_eval=True)).recipe
        assert r.distributed.nproc == cell.nproc and r.train.max_steps == 2
        assert r.train.global_batch_size % cell.nproc == 0


def test_crash_and_refusal_lines() -> None:
    output = (
        "step 1/2 | loss 5.5\n"
        "Traceback (most recent call last):\n"
        '  File "/x/site-packages/finetune/train/parallel/parallelize.py", line 10, in wrap\n'
        "    fully_shard(m)\n"
        '  File "/x/site-packages/torch/distributed/fsdp/_api.py", line 99, in fully_shard\n'
        "    raise RuntimeError('boom')\n"
        "RuntimeError: boom\n"
        "error: rank 0 failed: RuntimeError: boom\n"
    )
    exc, where = sweep_matrix.last_exception(output)
    assert exc == "RuntimeError: boom"
    assert where == "torch/distributed/fsdp/_api.py:99 (fully_shard), from finetune/train/parallel/parallelize.py:10 (wrap)"
    assert sweep_matrix.error_lines(output) == ["rank 0 failed: RuntimeError: boom"]
    assert sweep_matrix.last_exception("error: r.yaml:3: method: no") == ("", "")
    boxed = (  # a single-process run's traceback, drawn by rich
        "╭──── Traceback (most recent call last) ────╮\n"
        "│ /x/finetune/launch.py:71 in launch        │\n"
        "│   70 │   plan = plan_for_run(loaded)      │\n"
        "│ /x/finetune/plan/shapes.py:12 in count    │\n"
        "╰───────────────────────────────────────────╯\n"
        "AttributeError: 'str' object has no attribute 'bits'\n"
    )
    exc, where = sweep_matrix.last_exception(boxed)
    assert (exc, where) == ("AttributeError: 'str' object has no attribute 'bits'", "/x/finetune/plan/shapes.py:12 (count)")


# -- the matrix, end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.dist
def test_fixed_cells_train_or_are_refused(tmp_path: Path) -> None:
    cells = [c for c in sweep_matrix.FIXED if c.name not in TRAINED_ELSEWHERE]
    results = sweep_matrix.sweep(cells, tmp_path)
    _check(results, "fixed cells")


@pytest.mark.slow
@pytest.mark.dist
def test_sampled_cells_train_or_are_refused(tmp_path: Path) -> None:
    seed = sweep_seed()
    print(f"FINETUNE_SWEEP_SEED={seed} (python scripts/sweep_matrix.py --sample {SAMPLE_SIZE} --seed {seed})")
    cells = sweep_matrix.sample_cells(SAMPLE_SIZE, seed)
    results = sweep_matrix.sweep(cells, tmp_path)
    _check(results, f"sample of seed {seed} (FINETUNE_SWEEP_SEED={seed} reproduces it)")
