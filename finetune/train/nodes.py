"""Several nodes, one run: node 0's plan is the run's, and every node must bring the same recipe.

Each node's launcher loads its own recipe and plans on its own hardware, so nodes that see different memory
(or disk) could choose a different micro-batch or accumulation and then hang in mismatched collectives. Once
the process group exists, every rank sends its node's recipe fingerprint and plan to every other rank
(:func:`agree_with_node0`): all of them run node 0's plan, and a recipe that differs in anything but the
per-node sections (:data:`PER_NODE_SECTIONS`) stops every rank with the same one-sentence error.
"""

from __future__ import annotations

import json
import os
from typing import Any

from finetune.errors import UserError

#: Recipe sections that may differ between nodes: where outputs go (only rank 0 writes them) and the
#: hardware ``finetune plan`` plans for (a run uses the real one).
PER_NODE_SECTIONS = ("output", "hardware")


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


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list, str, type(None))) else str(value)


def agree_with_node0(recipe: dict[str, Any], plan: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Node 0's plan, after checking on every rank that every node runs node 0's recipe.

    ``recipe`` and ``plan`` are this node's (the launcher's spec); ``ctx`` a joined DistContext. Raises the
    same :class:`UserError` on every rank when a node's recipe differs, naming the node and the keys.
    """
    if not ctx.distributed:
        return plan
    import torch.distributed as dist

    mine = {"node": int(os.environ.get("GROUP_RANK", 0)), "recipe": run_fingerprint(recipe), "plan": plan}
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    # c10d may give global rank 0 to any node: node 0 is the launcher started with --node-rank 0
    first = next((e for e in everyone if e["node"] == 0), everyone[0])
    for other in everyone:
        keys = sorted(k for k in first["recipe"].keys() | other["recipe"].keys()
                      if first["recipe"].get(k) != other["recipe"].get(k))
        if keys:
            node = other["node"]
            shown = ", ".join(
                f"{k} ({_show(first['recipe'].get(k))} on node 0, {_show(other['recipe'].get(k))} on node {node})"
                for k in keys[:3]
            ) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            raise UserError(
                f"node {node}'s recipe differs from node 0's in {shown}: start every node with the same recipe "
                "and --set overrides (only output.* and hardware.* may differ)"
            )
    return first["plan"]
