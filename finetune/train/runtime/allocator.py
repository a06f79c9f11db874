"""CUDA's caching allocator in a training process: expandable segments, unless the user configured it.

The caching allocator reserves fixed-size segments and splits them for tensors; a freed block can be reused
only by a tensor that fits in it. FSDP2's all-gathered units, the varying widths of micro-batches (the trainer
pads each to its longest row) and the evaluation's KV cache free and request blocks of ever-changing sizes,
and the reserve grows with the fragments, past the slack the planner allows for the allocator. With
``expandable_segments:True`` a segment is a virtual range the allocator maps more pages into as it grows, so
blocks of a new size come from the same segment and freed ends are unmapped. PyTorch's documentation
(torch.cuda memory management) recommends it for exactly this pattern; torchtitan sets it for its trainers.

The allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` (``PYTORCH_ALLOC_CONF`` in newer releases) once, when CUDA
initialises: :func:`configure` runs in the launcher before anything touches CUDA, and the workers
torch.distributed.run starts inherit its environment. A user who set either variable keeps exactly that.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: The variables the allocator reads (the first is the one finetune sets).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
#: finetune's setting.
EXPANDABLE = "expandable_segments:True"


def configure(environ: MutableMapping[str, str] | None = None) -> tuple[str, str, bool]:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to :data:`EXPANDABLE` in ``environ`` (this process's environment by
    default) unless one of :data:`ALLOC_CONF_VARS` is set. Returns (variable, value, whether finetune set it)."""
    env = os.environ if environ is None else environ
    for name in ALLOC_CONF_VARS:
        if env.get(name):
            return name, env[name], False
    env[ALLOC_CONF_VARS[0]] = EXPANDABLE
    return ALLOC_CONF_VARS[0], EXPANDABLE, True


def describe(environ: MutableMapping[str, str] | None = None) -> str:
    """The run header's line: the allocator setting in force and who chose it."""
    env = os.environ if environ is None else environ
    for name in ALLOC_CONF_VARS:
        value = env.get(name)
        if value:
            who = "finetune's default" if (name, value) == (ALLOC_CONF_VARS[0], EXPANDABLE) else "set by you"
            return f"CUDA allocator: {name}={value} ({who})"
    return "CUDA allocator: torch's defaults"
