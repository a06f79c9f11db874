"""Samples -> packed rows -> a deterministic stream of global batches, split over ranks.

Packing puts several samples in one row of ``max_seq_len`` tokens, position ids restarting at 0 for each
sample and no attention mask. transformers (5.x, ``masking_utils.find_packed_sequence_indices``) then
builds a block-diagonal causal mask for sdpa and eager attention, so no token attends across samples; this
needs ``position_ids`` given, ``attention_mask=None`` and no KV cache (``use_cache=False``). The loss
(``finetune.objectives.loss``) also drops the target that would cross from one sample into the next.

The order of rows is a pure function of (seed, epoch): every process computes the same permutation and
takes its own slice of each global batch, so N processes see exactly the rows one process would.
(epoch, step_in_epoch) is the whole position in the stream; :meth:`BatchStream.position_state` saves it
with a fingerprint of the data so a resume on different data is refused.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, SupportsIndex, cast, overload

from finetune.errors import UserError
from finetune.objectives.loss import IGNORE_INDEX


class TokenIds(array):
    """Token ids (or labels) in 4 bytes each, where a list of ints takes 36: the rows of a large data set held for
    training. It is a sequence of ints that compares equal to a list or tuple of the same ints, as the lists it
    stands in for do, and prints as one."""

    __slots__ = ()

    def __new__(cls, values: Iterable[int] = ()) -> TokenIds:
        return cast(TokenIds, super().__new__(cls, "i", values))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and self.tolist() == list(other)
        return bool(super().__eq__(other))

    __hash__ = None  # mutable, as a list

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> TokenIds: ...
    def __getitem__(self, index: SupportsIndex | slice) -> int | TokenIds:
        item = super().__getitem__(index)
        return TokenIds(item) if isinstance(item, array) else item

    def __add__(self, other: array) -> TokenIds:  # any array of ints, as TokenIds
        return TokenIds(super().__add__(other))

    def __repr__(self) -> str:
        return repr(self.tolist())


def as_tensor(values: Sequence[int]) -> Any:
    """``values`` (a list, or :class:`TokenIds` read without a copy) as a 1-D tensor of int64."""
    import torch

    if isinstance(values, array) and values.typecode == "i" and len(values):
        return torch.frombuffer(values, dtype=torch.int32).long()
    return torch.tensor(values if isinstance(values, list) else list(values), dtype=torch.long)


@dataclass(slots=True)
class Example:
    """One training row: ids, labels (IGNORE_INDEX where the loss does not count), and for a packed row
    the position ids (restarting at 0 at each sample inside it); in a mixture, ``sources``: the source of each
    sample in it (its index in TaskData.mixture). A data set read from files holds them as :class:`TokenIds`, and
    ``labels`` may be the very object ``input_ids`` is where they are equal: the rows are read, never changed."""

    input_ids: Sequence[int]
    labels: Sequence[int]
    position_ids: Sequence[int] | None = None
    sources: tuple[int, ...] = ()


def pack(examples: list[Example], max_seq_len: int) -> list[Example]:
    """Pack samples into rows of at most ``max_seq_len`` tokens (best-fit decreasing; deterministic).

    Longest samples first, each into the fullest row it still fits in; a row's samples keep the order
    they were placed in. Position ids restart at 0 at every sample.
    """
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i))
    rows: list[list[int]] = []
    by_free: list[list[int]] = [[] for _ in range(max_seq_len + 1)]  # free tokens -> rows with that many
    free: list[int] = []
    for i in order:
        n = len(examples[i].input_ids)
        if n > max_seq_len:
            raise AssertionError("samples are truncated to max_seq_len before packing")
        row = next((by_free[c].pop() for c in range(n, max_seq_len + 1) if by_free[c]), None)
        if row is None:
            row = len(rows)
            rows.append([])
            free.append(max_seq_len)
        rows[row].append(i)
        free[row] -= n
        by_free[free[row]].append(row)
    # rows in order of their first sample's index, so the result does not depend on the length ties
    rows.sort(key=min)
    packed = []
    for members in rows:
        ids, labels, pos = TokenIds(), TokenIds(), TokenIds()
        sources: tuple[int, ...] = ()
        for i in sorted(members):
            ex = examples[i]
            ids.extend(ex.input_ids)
            labels.extend(ex.labels)
            pos.extend(range(len(ex.input_ids)))
            sources += ex.sources
        packed.append(Example(ids, labels, pos, sources))
    return packed


def collate(examples: list[Example], pad_id: int) -> dict[str, Any]:
    """A micro-batch as tensors, right-padded to its longest row.

    Padded samples get an ``attention_mask``; packed rows get ``position_ids`` and no attention mask
    (their padding is one more short sequence with its own positions, and has no labels). ``num_tokens``
    (a 0-d tensor) counts the tokens that are not padding, for throughput figures.
    """
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    packed = examples[0].position_ids is not None
    if packed:
        pos = torch.arange(width, dtype=torch.long).repeat(len(examples), 1)
    else:
        mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = as_tensor(e.input_ids)
        labels[i, :n] = as_tensor(e.labels)
        if packed:
            assert e.position_ids is not None, "a packed micro-batch's rows all have position ids"
            pos[i, :n] = as_tensor(e.position_ids)
            pos[i, n:] = torch.arange(width - n)
        else:
            mask[i, :n] = 1
    real = torch.tensor(sum(len(e.input_ids) for e in examples))
    if packed:
        return {"input_ids": ids, "labels": labels, "position_ids": pos, "num_tokens": real}
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "num_tokens": real}


def transfer_options(device: Any) -> tuple[bool, bool]:
    """How a host batch reaches ``device``: (pinned first, non-blocking). On CUDA both: a copy from pageable
    memory is staged by the driver through a pinned buffer of its own, and the host waits for it; from
    pinned memory the copy is a DMA the host only enqueues, ordered before the forward that reads it on the
    same stream (torch keeps the pinned block alive until the copy is done). Elsewhere a plain copy."""
    import torch

    on_gpu = torch.device(device).type == "cuda"
    return on_gpu, on_gpu


def to_device(t: Any, device: Any) -> Any:
    """``t`` (a host tensor of a batch) on ``device``, as :func:`transfer_options` says."""
    pin, non_blocking = transfer_options(device)
    return (t.pin_memory() if pin else t).to(device, non_blocking=non_blocking)


class BatchStream:
    """Deterministic global batches: the order is a pure function of (seed, epoch).

    Global batch ``s`` of an epoch holds rows ``order[s*G : (s+1)*G]`` (G = global batch size); the
    rows left over at the end of an epoch are not used in that epoch (a different few each epoch).
    Rank ``r`` of ``W`` takes the contiguous slice ``[r*G/W, (r+1)*G/W)`` of it and cuts that into
    micro-batches, so the union over ranks is the single-process global batch.
    """

    def __init__(self, examples: list[Example], global_batch_size: int, seed: int, pad_id: int) -> None:
        if len(examples) < global_batch_size:
            what = "packed rows" if examples and examples[0].position_ids is not None else "training samples"
            raise UserError(
                f"train.global_batch_size: {global_batch_size} is larger than the {len(examples)} {what}; lower it"
            )
        self.examples = examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.steps_per_epoch = len(examples) // global_batch_size

    def order(self, epoch: int) -> list[int]:
        """The permutation of row indices for ``epoch``."""
        idx = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
        return idx

    def rank_rows(self, epoch: int, step_in_epoch: int, *, rank: int, world_size: int) -> list[Example]:
        """The rows of global batch ``step_in_epoch`` of ``epoch`` that belong to ``rank``."""
        g = self.global_batch_size
        if g % world_size:
            raise UserError(f"train.global_batch_size: {g} is not divisible by the {world_size} processes")
        if not 0 <= step_in_epoch < self.steps_per_epoch:
            raise IndexError(f"step {step_in_epoch} is outside the epoch's {self.steps_per_epoch} steps")
        per_rank = g // world_size
        start = step_in_epoch * g + rank * per_rank
        return [self.examples[i] for i in self.order(epoch)[start : start + per_rank]]

    def micro_batches(
        self, epoch: int, step_in_epoch: int, *, rank: int, world_size: int, micro_batch_size: int
    ) -> list[dict[str, Any]]:
        """This rank's micro-batches of global batch ``step_in_epoch`` of ``epoch``."""
        mine = self.rank_rows(epoch, step_in_epoch, rank=rank, world_size=world_size)
        return [
            collate(mine[i : i + micro_batch_size], self.pad_id)
            for i in range(0, len(mine), micro_batch_size)
        ]

    def padding_fraction(self, micro_batch_size: int, world_size: int = 1, epoch: int = 0) -> float:
        """Fraction of the tokens of an epoch's micro-batches that are padding."""
        pad = total = 0
        for step in range(self.steps_per_epoch):
            for rank in range(world_size):
                rows = self.rank_rows(epoch, step, rank=rank, world_size=world_size)
                for i in range(0, len(rows), micro_batch_size):
                    lens = [len(r.input_ids) for r in rows[i : i + micro_batch_size]]
                    total += max(lens) * len(lens)
                    pad += max(lens) * len(lens) - sum(lens)
        return pad / total if total else 0.0

    def source_counts(self, epoch: int, step_in_epoch: int, keys: list[str]) -> dict[str, float]:
        """A mixture's samples in global batch ``step_in_epoch`` of ``epoch`` by source, as ``samples/KEY``
        (``keys``: TaskData.mixture); empty when the data is not a mixture."""
        if not keys:
            return {}
        counts = dict.fromkeys(keys, 0)
        for row in self.rank_rows(epoch, step_in_epoch, rank=0, world_size=1):
            for s in row.sources:
                counts[keys[s]] += 1
        return {f"samples/{k}": float(n) for k, n in counts.items()}

    def fingerprint(self) -> str:
        """A hash of the rows and the batch settings: equal fingerprints give equal streams."""
        h = hashlib.sha256(f"{self.seed}/{self.global_batch_size}/{len(self.examples)}".encode())
        for e in self.examples:
            h.update(len(e.input_ids).to_bytes(4, "little"))
            h.update(bytes(str(list(e.input_ids[:8])), "ascii"))
        return h.hexdigest()[:16]

    def position_state(self, epoch: int, step_in_epoch: int) -> dict[str, Any]:
        """The position to save in a checkpoint: the next global batch to run is (epoch, step_in_epoch)."""
        return {"epoch": epoch, "step_in_epoch": step_in_epoch, "fingerprint": self.fingerprint()}

    def restore_position(self, state: dict[str, Any]) -> tuple[int, int]:
        """(epoch, step_in_epoch) of a saved :meth:`position_state`; refuses a state saved on other data."""
        if state.get("fingerprint") != self.fingerprint():
            raise UserError(
                "--resume: the training data, data settings, train.seed or train.global_batch_size differ from the "
                "checkpoint's, so the data order cannot be resumed exactly; resume with the same recipe"
            )
        return int(state["epoch"]), int(state["step_in_epoch"])
