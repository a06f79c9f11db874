"""The trainer's training step against a plain transformers step: peak tensor memory of one optimizer step.

For each small configuration (GPT-2: Conv1D projections, tied head; Llama, Qwen2, Gemma-like), on the same
seeded weights and the same batch:

- plain: what a user writes: ``model(input_ids=..., labels=...).loss`` under ``torch.autocast(bf16)``,
  ``loss.backward()``, ``torch.optim.AdamW(model.parameters()).step()``;
- trainer: ``finetune.train.trainer.Trainer`` built in this process from a recipe (the real setup: model,
  optimizer, scheduler) and one ``train_step`` (forward and backward of the micro-batch, clipping, the update);
- planner: ``chosen_memory(..., first_step=True)`` for the same recipe, tensor memory (without the runtime
  overhead, which no tensor counter sees).

Both steps are measured by the same counter, :class:`StorageCounter`: a ``TorchDispatchMode`` that counts
the bytes of every live tensor storage (the model's parameters and buffers, and everything an operator
returns, views counted once), and records which were alive at the peak (``--breakdown``).

    python scripts/peak_vs_plain.py                 # every configuration
    python scripts/peak_vs_plain.py --only gpt2 --breakdown
    python scripts/peak_vs_plain.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "models" / "tiny-llama"

BATCH, SEQ = 4, 256

# Small models of several architectures (tiny-llama's byte-level tokenizer, ids < 264, reads every vocabulary).
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "vocab_size": 8192, "n_embd": 256, "n_layer": 3, "n_head": 4},
    "llama": {"model_type": "llama", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "tie_word_embeddings": True},
    "gemma": {"model_type": "gemma", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64},
}


# -- the counter -------------------------------------------------------------------------------------------
@dataclass
class _Live:
    ref: StorageWeakRef
    nbytes: int
    label: str


class StorageCounter(TorchDispatchMode):
    """Bytes of live tensor storages: those given to :meth:`track` and every storage an operator returns.

    After each operator, storages that were freed are dropped and the total is compared with the peak;
    ``at_peak`` lists (bytes, label) of the storages alive at the peak. A label is the operator that made
    the storage, its shape and dtype, and where: ``fwd <module path>``, ``bwd`` or ``other``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self.at_peak: list[tuple[int, str]] = []
        self._live: dict[int, _Live] = {}
        self._total = 0
        self._where: list[str] = []
        self._names: dict[int, str] = {}
        self._hooks: list[Any] = []

    def track(self, *objs: Any) -> None:
        """Count the storages of tensors, modules (parameters, buffers, gradients) and optimizers (state)
        that exist before the measured code."""
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                for name, m in obj.named_modules():
                    self._names[id(m)] = name
                for name, t in [*obj.named_parameters(), *obj.named_buffers()]:
                    self._add(t, f"{name} {tuple(t.shape)} {t.dtype}")
                    if getattr(t, "grad", None) is not None:
                        self._add(t.grad, f"{name}.grad")
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor):
                            self._add(v, f"optimizer {k}")
            elif isinstance(obj, torch.Tensor):
                self._add(obj, f"tensor {tuple(obj.shape)} {obj.dtype}")
        self._check()

    def _add(self, t: torch.Tensor, label: str) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        ref = StorageWeakRef(st)
        known = self._live.get(ref.cdata)
        if known is not None and not known.ref.expired():
            if st.nbytes() > known.nbytes:  # resized in place
                self._total += st.nbytes() - known.nbytes
                known.nbytes = st.nbytes()
            return
        if known is not None:
            self._total -= known.nbytes
        self._live[ref.cdata] = _Live(ref, st.nbytes(), label)
        self._total += st.nbytes()

    def _check(self) -> None:
        for key in [k for k, v in self._live.items() if v.ref.expired()]:
            self._total -= self._live.pop(key).nbytes
        if self._total > self.peak:
            self.peak = self._total
            self.at_peak = [(v.nbytes, v.label) for v in self._live.values()]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._check()  # what the operator freed (its inputs' last references) first, then what it made
        if torch._C._current_graph_task_id() != -1:
            where = "bwd"
        else:
            where = f"fwd {self._where[-1]}" if self._where else "other"
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, f"{func.__name__} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} [{where}]")
        self._check()
        return out

    def __enter__(self) -> StorageCounter:
        def pre(module: torch.nn.Module, args: Any) -> None:
            self._where.append(self._names.get(id(module), type(module).__name__))

        def post(module: torch.nn.Module, args: Any, out: Any) -> None:
            if self._where:
                self._where.pop()

        reg = torch.nn.modules.module
        self._hooks = [reg.register_module_forward_pre_hook(pre), reg.register_module_forward_hook(post)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def summary(self, top: int = 25) -> list[tuple[int, str]]:
        """The storages alive at the peak, largest first, the same labels summed (module paths kept)."""
        sums: dict[str, int] = {}
        for nbytes, label in self.at_peak:
            sums[label] = sums.get(label, 0) + nbytes
        return sorted(((b, k) for k, b in sums.items()), reverse=True)[:top]

    def by_kind(self) -> dict[str, int]:
        """Bytes at the peak per kind: parameters/buffers, gradients, optimizer state, forward, backward."""
        out: dict[str, int] = {}
        for nbytes, label in self.at_peak:
            if "[fwd" in label:
                kind = "forward"
            elif "[bwd]" in label:
                kind = "backward"
            elif "[other]" in label:
                kind = "other"
            elif ".grad" in label:
                kind = "grads"
            elif label.startswith("optimizer"):
                kind = "optimizer"
            else:
                kind = "params+buffers"
            out[kind] = out.get(kind, 0) + nbytes
        return out


# -- the two steps -----------------------------------------------------------------------------------------
def model_dir(arch: str, root: Path) -> Path:
    """A model directory for ``arch``: its config and tiny-llama's tokenizer; weights come from the seed."""
    from transformers import AutoConfig

    d = root / arch
    if not d.exists():
        d.mkdir(parents=True)
        facts = dict(CONFIGS[arch])
        AutoConfig.for_model(facts.pop("model_type"), **facts).save_pretrained(d)
        for f in TINY.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, d / f.name)
    return d


def rows(root: Path) -> Path:
    """Pre-tokenized rows of exactly SEQ tokens (no padding, no packing: one document per row)."""
    import random

    path = root / f"rows_{SEQ}.jsonl"
    if not path.exists():
        rng = random.Random(0)
        with path.open("w") as f:
            for _ in range(4 * BATCH):
                f.write(json.dumps({"input_ids": [rng.randrange(3, 256) for _ in range(SEQ)]}) + "\n")
    return path


def recipe(arch: str, root: Path, precision: str = "bf16", steps: int = 1) -> dict[str, Any]:
    """Full fine-tuning, one process, one micro-batch of BATCH rows of SEQ tokens per step, AdamW."""
    return {
        "model": {"path": str(model_dir(arch, root)), "init": "random"},
        "method": "full",
        "data": {"train": str(rows(root)), "format": "tokenized", "max_seq_len": SEQ, "packing": False},
        "train": {"max_steps": steps, "global_batch_size": BATCH, "micro_batch_size": BATCH, "lr": 1e-3, "seed": 0,
                  "optimizer": "adamw", "activation_checkpointing": False},
        "precision": precision,
        "distributed": {"strategy": "single", "nproc": 1},
        "eval": {"every": 0},
        "output": {"dir": str(root / f"run-{arch}"), "log_every": 1},
    }


def trainer_for(arch: str, root: Path, precision: str = "bf16", steps: int = 1) -> tuple[Any, Any]:
    """The trainer of ``arch``'s recipe, set up in this process (model, optimizer, data), and the recipe."""
    from finetune.plan.flowchart import plan_for_run
    from finetune.recipe.schema import load_recipe
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.trainer import Trainer

    path = root / f"{arch}.yaml"
    path.write_text(yaml.safe_dump(recipe(arch, root, precision, steps), sort_keys=False))
    loaded = load_recipe(path)
    plan = plan_for_run(loaded, nproc=1, nnodes=1, device="cpu")
    trainer = Trainer(loaded, plan, DistContext.from_env())
    with contextlib.redirect_stdout(sys.stderr):
        trainer.setup()
    return trainer, loaded


def batches(trainer: Any, steps: int) -> list[dict[str, torch.Tensor]]:
    """The trainer's micro-batches of its first ``steps`` steps (one per step)."""
    out = []
    for step in range(steps):
        micro = trainer.stream.micro_batches(0, step, rank=0, world_size=1, micro_batch_size=BATCH)
        assert len(micro) == 1, "one micro-batch per step"
        out.append(micro[0])
    return out


def plain_steps(
    arch: str, root: Path, steps: list[dict[str, torch.Tensor]], precision: str = "bf16", dropout: bool = True
) -> tuple[StorageCounter, list[float]]:
    """Plain steps (the model built from the same seed as the trainer's), one per batch, measured; the losses.
    ``dropout=False``: the model in eval mode (what ``from_pretrained`` returns), so without its dropout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir(arch, root))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train(dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter = StorageCounter()
    counter.track(model, *(t for b in steps for t in (b["input_ids"], b["labels"])))
    losses = []
    with counter:
        for batch in steps:
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
            with autocast:
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    return counter, losses


def trainer_steps(trainer: Any, steps: int) -> tuple[StorageCounter, list[float]]:
    """The trainer's first ``steps`` calls of ``train_step``, measured; their losses (token means)."""
    counter = StorageCounter()
    counter.track(trainer.model, trainer.optimizer)
    with counter, contextlib.redirect_stdout(sys.stderr):
        losses = [trainer.train_step().loss for _ in range(steps)]
    return counter, losses


def predicted(loaded: Any, trainer: Any, steps: int) -> int:
    """The planner's tensor memory for the trainer's plan: the first step's, or the steady state's (AdamW's
    state exists during the forward and backward from the second step on)."""
    from finetune.plan.flowchart import chosen_memory

    m = chosen_memory(loaded, trainer.plan, device="cpu", first_step=steps == 1)
    return int(m.total - m.overhead)


def measure(
    arch: str, root: Path, precision: str = "bf16", steps: int = 1, no_dropout: bool = False
) -> dict[str, Any]:
    """Plain and trainer peaks over ``steps`` steps, their ratio, the planner's prediction, the losses and
    the breakdowns; ``no_dropout``: also the plain step without dropout (``plain_no_dropout``)."""
    torch.manual_seed(0)
    trainer, loaded = trainer_for(arch, root, precision, steps)
    extra: dict[str, Any] = {}
    if no_dropout:
        counter, losses = plain_steps(arch, root, batches(trainer, steps), precision, dropout=False)
        extra = {"plain_no_dropout": counter.peak, "plain_no_dropout_loss": losses}
    plain, plain_loss = plain_steps(arch, root, batches(trainer, steps), precision)
    ours, ours_loss = trainer_steps(trainer, steps)
    pred = predicted(loaded, trainer, steps)
    return {
        "config": arch, "precision": precision, "plain": plain.peak, "trainer": ours.peak,
        "ratio": ours.peak / plain.peak, "predicted": pred, "predicted_vs_trainer": pred / ours.peak,
        "plain_loss": plain_loss, "trainer_loss": ours_loss,
        "plain_by_kind": plain.by_kind(), "trainer_by_kind": ours.by_kind(),
        "plain_top": plain.summary(), "trainer_top": ours.summary(), **extra,
    }


@contextlib.contextmanager
def workdir(path: str | None) -> Iterator[Path]:
    """``path`` (created) or a temporary directory."""
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="configurations to run")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps measured (2: with AdamW's state)")
    ap.add_argument("--no-dropout", action="store_true", help="also the plain step without dropout (eval mode)")
    ap.add_argument("--breakdown", action="store_true", help="print the largest storages alive at each peak")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    mib = 2**20
    results = []
    with workdir(args.dir) as root:
        for arch in args.only or list(CONFIGS):
            r = measure(arch, root, args.precision, args.steps, args.no_dropout)
            results.append(r)
            print(f"{arch:6s} plain {r['plain'] / mib:7.1f} MiB | trainer {r['trainer'] / mib:7.1f} MiB | "
                  f"trainer/plain {r['ratio']:.3f} | planner {r['predicted'] / mib:7.1f} MiB "
                  f"({100 * (r['predicted_vs_trainer'] - 1):+.1f}% of trainer) | "
                  f"loss plain {r['plain_loss'][-1]:.5f} trainer {r['trainer_loss'][-1]:.5f}", flush=True)
            if "plain_no_dropout" in r:
                print(f"{'':6s} plain without dropout {r['plain_no_dropout'] / mib:7.1f} MiB | trainer/plain "
                      f"{r['trainer'] / r['plain_no_dropout']:.3f}", flush=True)
            if args.breakdown:
                for side in ("plain", "trainer"):
                    kinds = ", ".join(f"{k} {v / mib:.1f}" for k, v in sorted(r[f"{side}_by_kind"].items()))
                    print(f"  {side} at its peak (MiB): {kinds}")
                    for nbytes, label in r[f"{side}_top"]:
                        print(f"    {nbytes / mib:7.2f}  {label}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
