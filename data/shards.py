"""The token shard format that train_gpt.py reads, defined once for the data tools.

A shard is a little-endian file: a header of 256 int32 (20240520, the format's magic number; 1,
its version; the token count; the rest zero), then the tokens as uint16. train_gpt.py keeps its own
copy of these few lines, so that the trainer stays one self-contained file.
"""

import struct

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
        with open(path, "rb") as f:
            first_bytes = f.read(HEADER_BYTES)
            size = f.seek(0, 2)
    except OSError:
        return None
    if len(first_bytes) < HEADER_BYTES or header_problem(first_bytes, size):
        return None
    return struct.unpack_from("<3i", first_bytes)[2]
