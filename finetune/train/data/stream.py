"""``data.streaming``: training rows read and tokenized while training, through a bounded shuffle buffer.

No list of the data is ever built: each source's ``.jsonl`` files are read line by line from a byte offset,
each line goes into a buffer of ``data.shuffle_buffer`` raw rows, and every sample of a global batch is a row
drawn from the buffer at random (train.seed), tokenized when drawn (the refill reads the next line). A mixture
picks the source of each line read by weight. When every file of a source is read, the source starts over
(its next pass), so a run of train.max_steps steps never runs dry.

The whole position is small and exact: per source (file, byte offset, line, pass), the two generators' states
and the buffer as the (source, file, offset, line) of each row it holds. A checkpoint saves it; a resume reads the
buffer's rows back from their offsets and draws what the uninterrupted run would have drawn.

Every rank reads the same stream and keeps its own slice of each global batch (as :class:`BatchStream` does):
the batches, and so the losses, do not depend on the number of processes, and a resume on another process
count continues the same stream. Each rank tokenizes the global batch's rows, a few milliseconds a step.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from finetune.errors import UserError
from finetune.train.data.batches import Example, collate
from finetune.train.data.formats import BAD, DROPPED_LONG, NO_LABELS, Encoder
from finetune.train.data.sources import ROW_COLUMN, WHERE_COLUMN, unreadable


@dataclass
class StreamSource:
    """One source of the stream: its recipe key, its ``.jsonl`` files and its weight (None: not a mixture, whose
    files are all one source, read in order)."""

    key: str
    files: list[Path]
    weight: float | None = None


@dataclass
class StreamSpec:
    """What a streamed run reads (TaskData.stream): the sources, the encoder, and the buffer's size."""

    sources: list[StreamSource]
    encoder: Encoder
    buffer_size: int
    on_bad_row: str
    fingerprint: str = ""


@dataclass
class _Cursor:
    """Where a source's reading is: the next line starts at ``offset`` of ``files[file]``, after line ``line``."""

    file: int = 0
    offset: int = 0
    line: int = 0
    passes: int = 0


@dataclass
class _Row:
    """A raw row in the buffer and where it came from."""

    source: int
    file: int
    offset: int
    line: int
    text: str


@dataclass
class StreamCounts:
    """What the stream has read so far: rows per source, and the bad, dropped and truncated ones drawn."""

    rows: list[int] = field(default_factory=list)
    bad: int = 0
    dropped: int = 0


def check_streamable(files: list[Path], key: str) -> None:
    """data.streaming reads ``.jsonl`` files: one sentence naming ``key`` for any other."""
    for f in files:
        if f.suffix != ".jsonl":
            raise UserError(
                f"{key}: data.streaming reads .jsonl files (one JSON object per line), but {f} is {f.suffix or 'not'} "
                "one; convert it to .jsonl, or set data.streaming: false"
            )


def stream_fingerprint(spec: StreamSpec, tokenizer_id: str) -> str:
    """A hash of what decides the stream besides the seed and the batch: files (names and sizes), weights,
    encoder settings, the tokenizer and the buffer's size. Content is not read: a stream never reads it whole."""
    h = hashlib.sha256(json.dumps([spec.encoder.settings(), tokenizer_id, spec.buffer_size], sort_keys=True,
                                  default=str).encode())
    for s in spec.sources:
        h.update(f"{s.key}/{s.weight}".encode())
        for f in s.files:
            h.update(f"{f}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


class StreamingBatches:
    """Global batches drawn from the stream, one after another; the same interface as :class:`BatchStream`.

    ``steps_per_epoch`` is the run's ``total_steps`` (a stream has no epochs: it starts over at its end), so the
    trainer's (epoch, step in epoch) is (0, step). Batch ``s`` is made when asked for once batches ``0..s-1`` are;
    asking again for the last one gives it again (every rank's slice, and the per-source counts, read it).
    """

    def __init__(self, spec: StreamSpec, global_batch_size: int, seed: int, pad_id: int, total_steps: int) -> None:
        self.spec = spec
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.steps_per_epoch = max(1, total_steps)
        self.weights = [s.weight for s in spec.sources]
        self.cursors = [_Cursor() for _ in spec.sources]
        self.buffer: list[_Row] = []
        self.draw = random.Random(f"stream/{seed}")  # which buffered row each sample is
        self.pick = random.Random(f"stream-sources/{seed}")  # which source each line read comes from
        self.counts = StreamCounts(rows=[0] * len(spec.sources))
        self.made = 0  # global batches made
        self.last: list[Example] = []
        self.where: list[str] = []  # the last batch's rows, as file:line
        self._open: dict[int, IO[bytes]] = {}

    # -- reading ----------------------------------------------------------------------------------------------
    def _handle(self, source: int) -> IO[bytes]:
        c = self.cursors[source]
        fh = self._open.get(source)
        if fh is None:
            fh = self.spec.sources[source].files[c.file].open("rb")
            fh.seek(c.offset)
            self._open[source] = fh
        return fh

    def _read(self, source: int) -> _Row:
        """The next non-blank line of ``source`` (starting over after its last file)."""
        c, files = self.cursors[source], self.spec.sources[source].files
        ends = 0  # file ends passed without a row
        while True:
            fh = self._handle(source)
            raw = fh.readline()
            if not raw:  # the end of this file: the next one, or the source's next pass
                fh.close()
                del self._open[source]
                ends += 1
                if ends > len(files):
                    raise UserError(f"{self.spec.sources[source].key}: its files hold no rows to stream")
                c.file, c.offset, c.line = c.file + 1, 0, 0
                if c.file == len(files):
                    c.file, c.passes = 0, c.passes + 1
                continue
            # lossless: bytes that are not UTF-8 are that row's problem when it is encoded (_encode)
            row = _Row(source, c.file, c.offset, c.line + 1, raw.decode("utf-8", errors="surrogateescape").strip())
            c.offset += len(raw)
            c.line += 1
            if row.text:
                self.counts.rows[source] += 1
                return row

    def _next_source(self) -> int:
        if len(self.weights) == 1:  # not a mixture: one source of every file, read in order
            return 0
        return self.pick.choices(range(len(self.weights)), weights=[w or 0.0 for w in self.weights])[0]

    def _fill(self) -> None:
        while len(self.buffer) < self.spec.buffer_size:
            self.buffer.append(self._read(self._next_source()))

    def _encode(self, row: _Row) -> Example | None:
        """The row's sample, or None (a bad row under on_bad_row: skip, or one left out as too long)."""
        path = self.spec.sources[row.source].files[row.file]
        where = f"{path}:{row.line}"
        try:
            text = row.text.encode("utf-8", errors="surrogateescape").decode("utf-8")  # bytes that are not UTF-8
            parsed = json.loads(text)
            json.dumps(parsed, ensure_ascii=False).encode("utf-8")  # every string a real text (no lone surrogate)
        except Exception as exc:  # whatever the line holds, it is that row's problem (as a file read whole)
            self._bad(f"{where}: {unreadable(exc)}")
            return None
        if not isinstance(parsed, dict):
            self._bad(f"{where}: expected a JSON object ({{...}}) per line, got {type(parsed).__name__}")
            return None
        out = self.spec.encoder({ROW_COLUMN: text, WHERE_COLUMN: where}, row.line)
        if out["status"] == BAD:
            self._bad(out["error"])
            return None
        if out["status"] in (DROPPED_LONG, NO_LABELS):
            self.counts.dropped += 1
            return None
        sources = (row.source,) if self.weights[0] is not None else ()
        self.where.append(where)
        return Example(out["input_ids"], out["labels"], None, sources)

    def _bad(self, error: str) -> None:
        """A bad row: the run stops at it (data.on_bad_row: error), or it is counted and left out (skip)."""
        if self.spec.on_bad_row == "error":
            raise UserError(f"{error}; fix the data, or set data.on_bad_row: skip to leave bad rows out")
        self.counts.bad += 1

    def _sample(self) -> Example:
        misses = 0
        while True:
            self._fill()
            i = self.draw.randrange(len(self.buffer))
            self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
            example = self._encode(self.buffer.pop())
            if example is not None:
                return example
            misses += 1
            if misses > 100 * self.spec.buffer_size + 1000:
                raise UserError("data.train: the stream holds no usable training samples (every row drawn was bad or left out)")

    # -- the batch stream's interface -------------------------------------------------------------------------
    def global_rows(self, epoch: int, step_in_epoch: int) -> list[Example]:
        """The rows of global batch (epoch, step_in_epoch): the next one, or the last one again."""
        step = epoch * self.steps_per_epoch + step_in_epoch
        if step == self.made - 1:
            return self.last
        assert step == self.made, f"a stream's batches are read in order: asked for {step}, next is {self.made}"
        self.where = []
        self.last = [self._sample() for _ in range(self.global_batch_size)]
        self.made += 1
        return self.last

    def rank_rows(self, epoch: int, step_in_epoch: int, *, rank: int, world_size: int) -> list[Example]:
        """This rank's contiguous slice of the global batch (as :meth:`BatchStream.rank_rows`)."""
        g = self.global_batch_size
        if g % world_size:
            raise UserError(f"train.global_batch_size: {g} is not divisible by the {world_size} processes")
        per_rank = g // world_size
        return self.global_rows(epoch, step_in_epoch)[rank * per_rank : (rank + 1) * per_rank]

    def micro_batches(
        self, epoch: int, step_in_epoch: int, *, rank: int, world_size: int, micro_batch_size: int
    ) -> list[dict[str, Any]]:
        """This rank's micro-batches of the global batch."""
        mine = self.rank_rows(epoch, step_in_epoch, rank=rank, world_size=world_size)
        return [collate(mine[i : i + micro_batch_size], self.pad_id) for i in range(0, len(mine), micro_batch_size)]

    def source_counts(self, epoch: int, step_in_epoch: int, keys: list[str]) -> dict[str, float]:
        """A mixture's samples in the global batch by source, as ``samples/KEY`` (empty when not a mixture)."""
        if not keys:
            return {}
        counts = dict.fromkeys(keys, 0)
        for row in self.global_rows(epoch, step_in_epoch):
            for s in row.sources:
                counts[keys[s]] += 1
        return {f"samples/{k}": float(n) for k, n in counts.items()}

    def fingerprint(self) -> str:
        """What decides the stream: the data's fingerprint, the seed and the global batch size."""
        return f"{self.spec.fingerprint}/{self.seed}/{self.global_batch_size}"

    def position_state(self, epoch: int, step_in_epoch: int) -> dict[str, Any]:
        """The stream's whole position after the batches made so far (which must be those before (epoch,
        step_in_epoch)): every source's cursor, both generators and the buffer's rows by place."""
        step = epoch * self.steps_per_epoch + step_in_epoch
        assert step == self.made, f"the stream's position is saved after batch {self.made}, not {step}"
        return {
            "epoch": epoch, "step_in_epoch": step_in_epoch, "fingerprint": self.fingerprint(),
            "stream": {
                "made": self.made,
                "cursors": [[c.file, c.offset, c.line, c.passes] for c in self.cursors],
                "draw": _rng_state(self.draw), "pick": _rng_state(self.pick),
                "buffer": [[r.source, r.file, r.offset, r.line] for r in self.buffer],
                "rows": list(self.counts.rows), "bad": self.counts.bad, "dropped": self.counts.dropped,
            },
        }

    def restore_position(self, state: dict[str, Any]) -> tuple[int, int]:
        """Continue from a saved :meth:`position_state`: the cursors, generators and the buffer (its rows read
        back from their offsets); refuses a state saved on other data or settings."""
        if state.get("fingerprint") != self.fingerprint() or "stream" not in state:
            raise UserError(
                "--resume: the streamed data (its files or their sizes), data settings, train.seed or "
                "train.global_batch_size differ from the checkpoint's, so the stream cannot be resumed exactly; "
                "resume with the same recipe and files"
            )
        s = state["stream"]
        for fh in self._open.values():
            fh.close()
        self._open = {}
        self.cursors = [_Cursor(*c) for c in s["cursors"]]
        _set_rng(self.draw, s["draw"])
        _set_rng(self.pick, s["pick"])
        self.buffer = [self._read_at(*place) for place in s["buffer"]]
        self.counts = StreamCounts(rows=list(s["rows"]), bad=int(s["bad"]), dropped=int(s["dropped"]))
        self.made, self.last = int(s["made"]), []
        return divmod(self.made, self.steps_per_epoch)

    def _read_at(self, source: int, file: int, offset: int, line: int) -> _Row:
        path = self.spec.sources[source].files[file]
        with path.open("rb") as fh:
            fh.seek(offset)
            text = fh.readline().decode("utf-8", errors="replace").strip()
        return _Row(source, file, offset, line, text)


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _set_rng(rng: random.Random, state: list[Any]) -> None:
    rng.setstate((state[0], tuple(state[1]), state[2]))
