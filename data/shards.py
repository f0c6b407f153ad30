"""The token shard format that train_gpt.py reads, defined once for the data tools: its reader
and its writer side by side.

A shard is a little-endian file: a header of 256 int32 (20240520, the format's magic number; 1,
its version; the token count; the rest zero), then the tokens as uint16. train_gpt.py keeps its own
copy of these few lines, so that the trainer stays one self-contained file.

ShardWriter lays documents out as train_gpt.py's data wants them: never split, the val shard first.
"""

import struct

import files
import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS
# the header's token count is an int32
MAX_TOKENS = 2 ** 31 - 1


def header(tokens):
    """The header of a shard holding `tokens` tokens."""
    return struct.pack("<3i", MAGIC, VERSION, tokens).ljust(HEADER_BYTES, b"\0")


def header_problem(first_bytes, size):
    """What is wrong with a shard of `size` bytes that starts with `first_bytes` (its header), or
    None."""
    magic, version, tokens = struct.unpack_from("<3i", first_bytes.ljust(12, b"\0"))
    if (magic, version) != (MAGIC, VERSION):
        return (f"not a valid shard (magic number {magic}, version {version}; "
                f"expected {MAGIC}, {VERSION})")
    if tokens < 0 or size != HEADER_BYTES + 2 * tokens:
        return f"not a valid shard ({size} bytes, but the header promises {tokens} tokens)"
    return None


def token_count(path):
    """The token count of a whole, valid shard at `path`, else None."""
    try:
        with files.open_checked(path) as f:
            first_bytes = f.read(HEADER_BYTES)
            size = f.seek(0, 2)
    except (OSError, files.FileProblem):
        return None
    if len(first_bytes) < HEADER_BYTES or header_problem(first_bytes, size):
        return None
    return struct.unpack_from("<3i", first_bytes)[2]


class LayoutError(ValueError):
    """Documents that the shards cannot hold as asked: the message says what to change."""


class Shard:
    """A shard being written under a temporary name, with its documents' token counts and positions
    (input index, line), and the position of the document after its last one (`end`)."""

    def __init__(self, folder, name, index):
        self.index = index
        self.name = f"{name}_val_{index:06d}.bin" if index == 0 else f"{name}_train_{index:06d}.bin"
        self.temp = files.temp_path(folder / self.name)
        self.end = None
        self.refill(np.empty(0, "<u2"), [], [])

    def refill(self, tokens, lengths, positions):
        """Hold these documents (instead of those it held: to even out the last two shards)."""
        self.file = open(self.temp, "wb")
        # the header is written once the count is known
        self.file.write(bytes(HEADER_BYTES))
        self.file.write(tokens)
        self.tokens = len(tokens)
        self.lengths = list(lengths)
        self.positions = list(positions)

    def append(self, tokens, position):
        self.file.write(tokens)
        self.tokens += len(tokens)
        self.lengths.append(len(tokens))
        self.positions.append(position)

    def close(self):
        if self.tokens > MAX_TOKENS:
            raise LayoutError(f"{self.name} would hold {self.tokens:,} tokens, more than a shard's "
                             f"header can count ({MAX_TOKENS:,}): lower --val_tokens")
        self.file.seek(0)
        self.file.write(header(self.tokens))
        self.file.close()


class ShardWriter:
    """Documents in, shards out: the val shard until it holds val_tokens, then train shards of at
    most shard_tokens. A finished train shard is held back (whole, under its temporary name) until
    the one after it holds half a shard, so that a short last shard can still be evened out with it
    (a run that goes on after an interruption makes that next shard again)."""

    def __init__(self, folder, name, val_tokens, shard_tokens, place, publish, first_index):
        self.folder = folder
        self.name = name
        self.val_tokens = val_tokens
        self.shard_tokens = shard_tokens
        # place(position): "FILE: line N", for errors; publish(shard): once renamed into place
        self.place = place
        self.publish = publish
        self.next_index = first_index
        self.current = None
        self.held = None
        # shards with a temporary file, for discard
        self.unrenamed = []

    def add(self, tokens, position):
        """One document's tokens (EOT first), found at `position` (input index, line)."""
        current = self.current
        if current is None:
            for_val = self.next_index == 0
        else:
            for_val = current.index == 0 and current.tokens < self.val_tokens
        if not for_val and len(tokens) > self.shard_tokens:
            raise LayoutError(f"{self.place(position)}: a document of {len(tokens):,} tokens, more "
                             f"than --shard_tokens {self.shard_tokens:,}: documents are never "
                             "split; raise it")
        full = current is not None and current.tokens + len(tokens) > self.shard_tokens
        if current is not None and current.index == 0 and not for_val:
            self.finish_current(position)
        elif full and current.index > 0:
            self.finish_current(position)
        if self.current is None:
            self.current = Shard(self.folder, self.name, self.next_index)
            self.unrenamed.append(self.current)
            self.next_index += 1
        self.current.append(tokens, position)
        # now the last shard cannot be short
        if self.held and self.current.tokens >= self.shard_tokens / 2:
            self.rename(self.held)
            self.held = None

    def finish_current(self, end):
        shard = self.current
        self.current = None
        shard.end = end
        shard.close()
        if self.held:
            self.rename(self.held)
            self.held = None
        if shard.index == 0:
            self.rename(shard)
        else:
            self.held = shard

    def finish(self, end):
        """At the end of the inputs: even out a short last train shard with the one before; rename
        them."""
        last = self.current
        # resumed after the last shard: nothing was left
        if last is None and self.next_index > 1:
            return
        if last is None or last.index == 0:
            total = 0 if last is None else last.tokens
            raise LayoutError(f"the inputs hold {total:,} tokens, all for the val shard "
                             f"(--val_tokens {self.val_tokens:,}), none left to train on: lower "
                             "--val_tokens, or add text")
        last.end = end
        last.close()
        held = self.held
        self.held = None
        if held is not None:
            # under 1.5 shards, once at the end
            tokens = np.concatenate([np.fromfile(shard.temp, "<u2", offset=HEADER_BYTES)
                                     for shard in (held, last)])
            lengths = held.lengths + last.lengths
            positions = held.positions + last.positions
            # how many go to the first, so that the smaller holds the most, each at most a shard
            first = np.cumsum(lengths)[:-1]
            second = first[-1] + lengths[-1] - first
            fits = (first <= self.shard_tokens) & (second <= self.shard_tokens)
            split = int(np.argmax(np.where(fits, np.minimum(first, second), -1))) + 1
            cut = sum(lengths[:split])
            held.refill(tokens[:cut], lengths[:split], positions[:split])
            held.end = positions[split]
            held.close()
            last.refill(tokens[cut:], lengths[split:], positions[split:])
            last.close()
            self.rename(held)
        self.rename(last)

    def rename(self, shard):
        files.put_in_place(shard.temp, self.folder / shard.name)
        self.unrenamed.remove(shard)
        self.publish(shard)

    def discard(self):
        """Delete the temporary files (after an error or an interruption)."""
        for shard in self.unrenamed:
            shard.file.close()
            shard.temp.unlink(missing_ok=True)
