"""Per-rank host memory of LoRA under fsdp on 2 processes, by how the checkpoint is stored, against the plan.

The model: tiny-llama's config scaled up, ``--model 151m`` (the default: hidden 1024, 13 layers, 577 MiB in
fp32, 289 MiB in bf16, a decoder layer 22 MiB in bf16) or ``312m`` (24 layers with an MLP of 3200: 1190 MiB in
fp32, 595 MiB in bf16, a layer 24.8 MiB), with weights drawn from seed 0, saved once in fp32 and once in bf16
in a temporary directory; the baseline is the tiny model (3M parameters, fp32). Each runs `finetune run`:
method lora (r 8, bf16 base), fsdp on 2 gloo processes, one step of 48 tokens.
tests/hostmem_hooks.py, installed through $FINETUNE_HOOKS, samples each rank's RssAnon (/proc/self/status)
every millisecond: ``load`` is Trainer._setup_model (build on meta, shard, load this rank's shards), ``run``
the whole run from the hooks' start.

Printed per rank: the peak RssAnon while loading and over the run, the run's peak above the tiny run's, and
the bound it is held to (half the model in bf16 + three decoder layers + 64 MiB), and where the step's part of
it goes (RssAnon when the step starts, after loading, and the step's peak above that); per node: the plan's host
figures (plan.json of the run: ``host_loading_per_node``, ``host_peak_per_node``) against the sum of the
ranks' measured peaks. ``--old-ref REF`` runs the same models with the code of git ref REF too
(``git archive`` into the temporary directory, run with this interpreter), for a before/after.

    python scripts/bench_load_memory.py [--model 151m|312m] [--old-ref REF]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.distributed.test_load_memory import finish_run, save_seeded, start_lora_run  # noqa: E402

MiB = 2**20
#: tiny-llama scaled up: 151M parameters, the byte tokenizer's 264 rows of embeddings.
BIG = {
    "hidden_size": 1024,
    "intermediate_size": 2752,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_hidden_layers": 13,
}
#: The shapes ``--model`` names: BIG, and a 312M-parameter model of 24 layers.
MODELS = {"151m": BIG, "312m": {**BIG, "intermediate_size": 3200, "num_hidden_layers": 24}}


def measure(tmp: Path, names: list[str], code: Path | None, tag: str) -> dict[str, tuple[dict, dict]]:
    """Run ``names`` (model directories under ``tmp``) two at a time; each one's phases and plan job figures."""
    out: dict[str, tuple[dict, dict]] = {}
    for i in range(0, len(names), 2):
        runs = {n: start_lora_run(tmp, f"{tag}-{n}", tmp / n, code) for n in names[i : i + 2]}
        out.update({n: finish_run(*run) for n, run in runs.items()})
    return out


def report(label: str, got: dict[str, tuple[dict, dict]], sizes: dict[str, dict[str, int]]) -> None:
    """The per-rank and per-node tables of one version of the code."""
    tiny = got["tiny"][0]
    print(f"\n{label}: peak RssAnon per rank (MiB)")
    print(f"{'model':<12}{'rank':>5}{'load':>8}{'run':>8}{'over tiny':>11}{'bound':>8}{'step from':>11}{'step +':>8}")
    for name, (phases, _) in got.items():
        bound = sizes[name]["bf16"] // 2 + 3 * sizes[name]["block"] + 64 * MiB if name != "tiny" else 0
        for rank in (0, 1):
            over = phases[rank]["run"]["peak"] - tiny[rank]["run"]["peak"]
            step = phases[rank]["step"]
            print(
                f"{name:<12}{rank:>5}{phases[rank]['load']['peak'] / MiB:>8.0f}{phases[rank]['run']['peak'] / MiB:>8.0f}"
                f"{over / MiB:>11.0f}{bound / MiB:>8.0f}{step['start'] / MiB:>11.0f}{(step['peak'] - step['start']) / MiB:>8.0f}"
            )
    print(f"{label}: host memory per node (MiB), the plan against the sum of the ranks' peaks")
    print(f"{'model':<12}{'loading plan':>14}{'measured':>10}{'ratio':>7}{'peak plan':>11}{'measured':>10}{'ratio':>7}")
    for name, (phases, job) in got.items():
        load = sum(phases[r]["load"]["peak"] for r in (0, 1))
        run = sum(phases[r]["run"]["peak"] for r in (0, 1))
        print(
            f"{name:<12}{job['host_loading_per_node'] / MiB:>14.0f}{load / MiB:>10.0f}"
            f"{job['host_loading_per_node'] / load:>7.2f}{job['host_peak_per_node'] / MiB:>11.0f}{run / MiB:>10.0f}"
            f"{job['host_peak_per_node'] / run:>7.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-ref", help="also run the code of this git ref (before/after)")
    ap.add_argument("--model", choices=sorted(MODELS), default="151m", help="the scaled-up model's size")
    args = ap.parse_args()
    big_shape = MODELS[args.model]
    with tempfile.TemporaryDirectory(prefix="bench-load-memory-") as t:
        tmp = Path(t)
        sizes = {
            "tiny": save_seeded(tmp / "tiny", {}, "float32"),
            "big-fp32": save_seeded(tmp / "big-fp32", big_shape, "float32"),
            "big-bf16": save_seeded(tmp / "big-bf16", big_shape, "bfloat16"),
        }
        big = sizes["big-fp32"]
        print(
            f"model: {big['bf16'] / 2 / 1e6:.0f}M parameters, {big['file'] / MiB:.0f} MiB in fp32 on disk, "
            f"{sizes['big-bf16']['file'] / MiB:.0f} MiB in bf16, a decoder layer {big['block'] / MiB:.1f} MiB in bf16; "
            "lora under fsdp x2 on gloo, one step"
        )
        names = list(sizes)
        report("this checkout", measure(tmp, names, None, "new"), sizes)
        if args.old_ref:
            old = tmp / "old"
            old.mkdir()
            subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(tmp / "old.tar"), args.old_ref], check=True)
            with tarfile.open(tmp / "old.tar") as f:
                f.extractall(old, filter="data")
            report(f"git {args.old_ref}", measure(tmp, names, old, "old"), sizes)


if __name__ == "__main__":
    main()
