"""Uploading a run's model or adapter to the Hugging Face Hub, with a model card (``output.push_to_hub``,
``finetune merge --push-to-hub``).

The card (README.md, written beside the weights) holds what makes the upload reproducible: the resolved recipe,
the plan the run executed with its predicted and measured memory, and the final metrics. huggingface_hub does
the upload (``create_repo``, private unless asked, then ``create_commit`` of an explicit list of files: what
the run or the merge wrote, never the folder as a whole); ``HF_ENDPOINT`` points it at another server,
``HF_TOKEN`` authenticates (huggingface_hub reads it; finetune never writes or prints it). Checkpoints,
tracker files, memory snapshots and anything else in the folder stay local.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.recipe.locate import hub_offline, looks_like_hub_id

#: The run's own records that an upload of its model sends beside it (each when it exists) and the card.
RUN_RECORDS = ("recipe.yaml", "plan.json", "memory.json", "metrics.jsonl")
CARD = "README.md"


def check_push(key: str, repo_id: str | None) -> None:
    """Refuse an upload that cannot happen, before training: a malformed id, or the Hub switched off."""
    if not repo_id:
        return
    if not looks_like_hub_id(repo_id):
        raise UserError(f"{key}: `{repo_id}` is not a Hub repository id; write it as org/name")
    if hub_offline():
        raise UserError(
            f"{key}: uploading to `{repo_id}` needs the Hub, but HF_HUB_OFFLINE=1 (or --offline) is set"
        )


def _last_metrics(run_dir: Path) -> dict[str, Any]:
    """The last value of every metric in metrics.jsonl (the final eval is the last row that has one)."""
    path = run_dir / "metrics.jsonl"
    last: dict[str, Any] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                last.update(json.loads(line))
    return last


def model_card(run_dir: Path, *, merged_from: str | None = None) -> str:
    """README.md for the folder at ``run_dir``: front matter, final metrics, the plan, the recipe."""
    import yaml

    recipe_text = (run_dir / "recipe.yaml").read_text() if (run_dir / "recipe.yaml").is_file() else ""
    recipe = yaml.safe_load(recipe_text) if recipe_text else {}
    plan = json.loads((run_dir / "plan.json").read_text()) if (run_dir / "plan.json").is_file() else {}
    memory = json.loads((run_dir / "memory.json").read_text()) if (run_dir / "memory.json").is_file() else {}
    adapter = (run_dir / "adapter_config.json").is_file()
    chosen = plan.get("chosen", {})
    base = str((recipe.get("model") or {}).get("path", ""))
    front = {
        "library_name": "peft" if adapter else "transformers",
        "tags": ["finetune", chosen.get("method", "full")],
    }
    if looks_like_hub_id(base):
        front["base_model"] = base
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {run_dir.name}", ""]
    what = "a LoRA/QLoRA adapter" if adapter else "a model"
    lines.append(
        f"This is {what} fine-tuned with `finetune`"
        + (f" from `{base}`" if base else "")
        + (f", merged from the adapter run `{merged_from}`" if merged_from else "")
        + "."
    )
    last = _last_metrics(run_dir)
    if last:
        lines += ["", "## Final metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in last.items()]
    if chosen:
        lines += ["", "## Plan", "", "| | |", "|---|---|"]
        for k in (
            "method",
            "strategy",
            "precision",
            "micro_batch_size",
            "grad_accum_steps",
            "activation_checkpointing",
            "nproc",
            "nnodes",
        ):
            if k in chosen:
                lines.append(f"| {k} | {chosen[k]} |")
        mem = chosen.get("memory", {})
        if mem.get("total"):
            lines.append(f"| predicted memory per process | {mem['total'] / 2**20:,.1f} MiB |")
        if memory.get("measured_peak"):
            lines.append(
                f"| measured peak ({memory.get('device', '')}) | {memory['measured_peak'] / 2**20:,.1f} MiB |"
            )
    if recipe_text:
        lines += ["", "## Recipe", "", "```yaml", recipe_text.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def upload_list(folder: Path, files: list[str]) -> list[str]:
    """The names of ``files`` to upload from ``folder``, each checked to be a plain file inside it (a name with a
    separator or ``..``, or a symlink leading out, is refused): the card last, each name once."""
    names = list(dict.fromkeys([*(f for f in files if f != CARD), CARD]))
    root = Path(os.path.realpath(folder))
    for name in names:
        path = folder / name
        if "/" in name or "\\" in name or name in ("", ".", "..") or not path.is_file():
            raise UserError(f"{folder}: `{name}` is not a file of the folder; nothing was uploaded")
        if not Path(os.path.realpath(path)).is_relative_to(root):
            raise UserError(f"{path} leads outside {folder} (a symlink); nothing was uploaded")
    return names


def push_folder(
    folder: Path, repo_id: str, *, key: str, card: str, message: str, files: list[str], private: bool = True
) -> str:
    """Write ``card`` as README.md in ``folder`` and upload it and ``files`` (names in ``folder``: what the run or
    merge wrote) to ``repo_id`` in one commit, creating the repository ``private`` unless it exists; return the
    commit URL. A refused or failed upload is one sentence naming ``key``."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    check_push(key, repo_id)
    (folder / CARD).write_text(card)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name))
                  for name in upload_list(folder, files)]
    api = HfApi()
    try:
        api.create_repo(repo_id, exist_ok=True, private=private)
        info = api.create_commit(repo_id, operations, commit_message=message)
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        hint = " (log in with `hf auth login` or set HF_TOKEN)" if status in (401, 403) else ""
        raise UserError(
            f"{key}: the Hub refused the upload to `{repo_id}`: {str(err).splitlines()[0]}{hint}"
        ) from None
    except Exception as err:
        if isinstance(err, OSError) or type(err).__module__.split(".")[0] in (
            "httpx",
            "httpx2",
            "httpcore",
            "httpcore2",
        ):
            from finetune.recipe.locate import hub_endpoint

            raise UserError(
                f"{key}: could not reach the Hugging Face Hub at {hub_endpoint()} to upload `{repo_id}` "
                f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); the files stay in {folder}"
            ) from None
        raise
    return str(getattr(info, "commit_url", info))
