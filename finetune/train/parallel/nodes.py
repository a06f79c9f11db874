"""Several nodes, one run: node 0's plan is the run's, and every node must bring the same recipe, the same
software and the same inputs, and see the same output directory.

Each node's launcher loads its own recipe and plans on its own hardware, so nodes that see different memory
(or disk) could choose a different micro-batch or accumulation and then hang in mismatched collectives. Once
the process group exists, every rank sends its node's facts to every other rank (:func:`agree_with_node0`):
the recipe's fingerprint, the plan, the versions of the packages a step runs through, and fingerprints of the
model's config and of every data file as that node reads them. All of them run node 0's plan; a recipe that
differs in anything but the per-node sections (:data:`PER_NODE_SECTIONS`), another package version, or another
model config or data file stops every rank with the same one-sentence error.

Then every node proves it sees node 0's output directory (:func:`check_shared_output`): rank 0 writes a random
token there, and every rank reads it back from its own ``output.dir``. Ranks on several nodes write their shards
of each checkpoint into one directory, so a node whose ``output.dir`` is not that directory (a local path, a
typo) would leave every checkpoint incomplete; it is refused before training.

Everything travels as JSON in byte tensors (:func:`finetune.train.parallel.distributed.all_gather_json`), never as
pickles. The c10d store and the process groups themselves are unauthenticated: several nodes need a trusted
network (docs/security.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from finetune.errors import UserError

#: Recipe sections that may differ between nodes: where outputs go (only rank 0 writes them) and the
#: hardware ``finetune plan`` plans for (a run uses the real one).
PER_NODE_SECTIONS = ("output", "hardware")
#: Packages whose versions every node must share: what the step, the checkpoint and the data run through.
PACKAGES = ("finetune", "torch", "transformers", "peft", "datasets", "safetensors", "tokenizers", "bitsandbytes")
#: The file rank 0 writes into output.dir for the other nodes to find (then its token's start).
TOKEN_PREFIX = ".finetune-node-check-"
#: Seconds a rank keeps looking for the token (a network filesystem may show a new file late).
TOKEN_WAIT_S = 10.0


def run_fingerprint(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe as ``{dotted.key: value}`` without the per-node sections: what every node must agree on."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            flat[prefix] = node

    for section, value in recipe.items():
        if section not in PER_NODE_SECTIONS:
            walk(value, section)
    return flat


def package_versions() -> dict[str, str | None]:
    """The installed version of each of :data:`PACKAGES` (None where it is not installed)."""
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def input_fingerprints(loaded: Any) -> dict[str, str]:
    """What this node reads, by name: the model's config.json (its SHA-256) and weight files (their sizes), and
    every local data file of data.train, data.eval and eval.retain (SHA-256)."""
    from finetune.recipe.reference_model import weight_files

    inputs = loaded.inputs
    if inputs is None:
        return {}
    found: dict[str, str] = {}
    if inputs.model.kind in ("dir", "hub-cache"):
        model = Path(inputs.model.path)
        if (model / "config.json").is_file():
            found["the model's config.json"] = _sha256(model / "config.json")
        for f in weight_files(model):
            found[f"the model's {f.name}"] = f"{f.stat().st_size} bytes"
    locations = [("data.train", t) for t in inputs.train] + [("data.eval", inputs.eval), ("eval.retain", inputs.retain)]
    for key, location in locations:
        if location is None or location.kind != "files":
            continue
        try:
            files = location.files(key)
        except UserError:
            continue  # no files: the data loader says so on every node
        for f in files:
            found[f"the data file {f} ({key})"] = _sha256(f)
    return found


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list, str, type(None))) else str(value)


def _short(value: Any) -> str:
    text = "missing" if value is None else str(value)
    return text[:12] + "..." if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else text


def _differences(first: dict[str, Any], other: dict[str, Any]) -> list[str]:
    return sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))


def agree_with_node0(
    recipe: dict[str, Any], plan: dict[str, Any], ctx: Any, inputs: dict[str, str] | None = None
) -> dict[str, Any]:
    """Node 0's plan, after checking on every rank that every node runs node 0's recipe with the same package
    versions and inputs (``inputs``: this node's :func:`input_fingerprints`, from one rank per node; None on the
    others).

    ``recipe`` and ``plan`` are this node's (the launcher's spec); ``ctx`` a joined DistContext. Raises the
    same :class:`UserError` on every rank when a node differs, naming the node and what differs.
    """
    if not ctx.distributed:
        return plan
    from finetune.train.parallel.distributed import all_gather_json

    mine = {
        "node": int(os.environ.get("GROUP_RANK", 0)), "recipe": run_fingerprint(recipe), "plan": plan,
        "versions": package_versions(), "inputs": inputs, "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
    }
    everyone = all_gather_json(mine)
    # c10d may give global rank 0 to any node: node 0 is the launcher started with --node-rank 0
    first = next((e for e in everyone if e["node"] == 0 and e["inputs"] is not None),
                 next((e for e in everyone if e["node"] == 0), everyone[0]))
    for other in everyone:
        node = other["node"]
        keys = _differences(first["recipe"], other["recipe"])
        if keys:
            shown = ", ".join(
                f"{k} ({_show(first['recipe'].get(k))} on node 0, {_show(other['recipe'].get(k))} on node {node})"
                for k in keys[:3]
            ) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            raise UserError(
                f"node {node}'s recipe differs from node 0's in {shown}: start every node with the same recipe "
                "and --set overrides (only output.* and hardware.* may differ)"
            )
        for part, what, fix in (
            ("versions", "package versions", "install the same versions on every node"),
            ("inputs", "inputs", "give every node the same model and data files (a shared filesystem, or copies)"),
        ):
            if first[part] is None or other[part] is None:  # inputs: read by one rank per node
                continue
            keys = _differences(first[part], other[part])
            if keys:
                shown = ", ".join(
                    f"{k} ({_short(first[part].get(k))} on node 0, {_short(other[part].get(k))} on node {node})"
                    for k in keys[:2]
                ) + (f" and {len(keys) - 2} more" if len(keys) > 2 else "")
                raise UserError(f"node {node}'s {what} differ from node 0's: {shown}; {fix}")
    return first["plan"]


def several_nodes() -> bool:
    """Whether torchrun started this job on more than one node (its GROUP_WORLD_SIZE: the nodes' agents)."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1) > 1


def nodes_of(ctx: Any) -> int:
    """How many nodes this job spans (from every rank's GROUP_RANK)."""
    if not ctx.distributed:
        return 1
    from finetune.train.parallel.distributed import all_gather_json

    return len(set(all_gather_json(int(os.environ.get("GROUP_RANK", 0)))))


def check_shared_output(out_dir: str | os.PathLike[str], ctx: Any) -> None:
    """On a job of several nodes, prove that every rank's ``out_dir`` is rank 0's directory: rank 0 writes a
    random token there, every rank looks for it in its own (for up to :data:`TOKEN_WAIT_S`), rank 0 removes it.
    Raises the same :class:`UserError` on every rank naming the nodes that do not see it."""
    if nodes_of(ctx) < 2:
        return
    from finetune.train.parallel.distributed import all_gather_json

    out = Path(out_dir)
    sent: list[str] | None = None
    error = None
    if ctx.is_main:
        token = secrets.token_hex(16)
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{TOKEN_PREFIX}{token[:16]}").write_text(token)
            sent = [f"{TOKEN_PREFIX}{token[:16]}", token]
        except OSError as exc:
            error = f"{out}: {exc.strerror or exc}"
    name_and_token = all_gather_json(sent if ctx.is_main else None)[0]
    if name_and_token is None:
        raise UserError(f"output.dir: rank 0 cannot write into {error}; choose a writable directory every node shares")
    name, token = name_and_token
    deadline = time.monotonic() + TOKEN_WAIT_S
    sees = False
    while True:
        try:
            os.listdir(out)  # a network filesystem revalidates the directory on a listing
            sees = (out / name).read_text() == token
        except OSError:
            sees = False
        if sees or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    reports = all_gather_json({"node": int(os.environ.get("GROUP_RANK", 0)), "host": socket.gethostname(),
                               "dir": str(out), "sees": sees})
    if ctx.is_main:
        (out / name).unlink(missing_ok=True)
    blind = [r for r in reports if not r["sees"]]
    if blind:
        first = blind[0]
        nodes = sorted({r["node"] for r in blind})
        writer = reports[0]
        raise UserError(
            f"output.dir: node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))} ({first['host']}: "
            f"{first['dir']}) do{'' if len(nodes) > 1 else 'es'} not see the file rank 0 wrote into {writer['dir']} "
            f"on node {writer['node']}; on several nodes output.dir must be one directory on a filesystem every node "
            "shares: give every node that shared path"
        )
