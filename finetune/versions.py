"""What the installed torch and transformers offer, where releases above pyproject's floors (torch 2.11,
transformers 5.17) renamed or added an API the package uses: one place that asks, so that no other module
compares version strings.

- torch 2.13 adds ``DistributedDataParallel(forward_sync_buffers=)`` and deprecates ``broadcast_buffers=``
  (which, when False, also skips the buffers' broadcast at wrap time; the package's only buffers are rotary
  tables, equal on every rank by construction, so both spellings train alike);
- transformers 5.24 renames the KV cache ``past_key_values`` -> ``cache``: the models' and
  ``masking_utils.create_causal_mask``'s keyword and the output field (5.24 still takes the old keyword, with a
  FutureWarning).

Each answer is read from the installed package itself (a signature, a dataclass's fields), never from its
version string, and kept for the process. No torch or transformers at import time (the CLI imports the
modules that import this one).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import warnings
from typing import Any


def quiet_library_notes() -> None:
    """Silence library chatter that tells a user of the tool nothing: bitsandbytes' note about an optional CPU
    kernel package, and a transformers deprecation that peft triggers. Called where a command starts (the CLI's
    commands, each worker process), never at import: importing finetune changes no logging or warnings setting."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)


@functools.cache
def ddp_has_forward_sync_buffers() -> bool:
    """Whether ``DistributedDataParallel`` takes ``forward_sync_buffers=`` (torch 2.13 and later)."""
    from torch.nn.parallel import DistributedDataParallel

    return "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def ddp_no_buffer_sync() -> dict[str, Any]:
    """The keyword that turns off DDP's broadcast of buffers before every forward: ``forward_sync_buffers``
    where torch has it, else ``broadcast_buffers`` (whose False also skips the broadcast at wrap time)."""
    return {"forward_sync_buffers": False} if ddp_has_forward_sync_buffers() else {"broadcast_buffers": False}


@functools.cache
def kv_cache_name() -> str:
    """The name transformers gives the KV cache: ``cache`` (5.24 and later) or ``past_key_values``: the keyword
    of a model's forward and of ``create_causal_mask``, and the field of its outputs."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


def kv_cache_kwarg(cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for a model's forward or ``create_causal_mask``, under this transformers' name."""
    return {kv_cache_name(): cache}


def output_cache(output: Any) -> Any:
    """The KV cache of a model's output (None when it has none)."""
    return getattr(output, kv_cache_name(), None)


def report() -> dict[str, Any]:
    """The installed torch, transformers, peft, bitsandbytes and datasets, and which of the detected APIs they
    have (for the GPU check's preconditions and scripts/check_versions.sh)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, Any] = {}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "datasets"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    found["ddp_forward_sync_buffers"] = ddp_has_forward_sync_buffers()
    found["kv_cache_name"] = kv_cache_name()
    return found
