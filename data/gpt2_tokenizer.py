"""GPT-2's byte-pair encoding, the tokenizer of the FineWeb shards, through tiktoken.

Online, tiktoken downloads it on first use and caches it. Offline, every tool that tokenizes takes
`--tokenizer FILE`: a tiktoken ranks file of GPT-2's BPE (`gpt2.tiktoken`, as shipped in the
openai-whisper package), from which the same encoding is built here, with tiktoken's own pattern.
Used by data/text_to_shards.py and evals/.
"""
import base64
import hashlib

import files

# <|endoftext|>: the one special token, leading every document
EOT = 50256
# mergeable ranks: 256 bytes and 50,000 merges
GPT2_RANKS = 50256
# fingerprint() of GPT-2's encoding: every token's bytes and id
GPT2_FINGERPRINT = "gpt2 7fc8d184b157a4e0"
TOKENIZER_HINT = "pass --tokenizer FILE, a tiktoken ranks file of GPT-2's BPE (gpt2.tiktoken)"


class TokenizerError(Exception):
    """The encoding cannot be had: the message says what to do."""


def gpt2_encoding(tokenizer_file=None):
    """GPT-2's encoding: from tokenizer_file when given, else tiktoken's own (downloaded once, then
    cached)."""
    try:
        import tiktoken
        import tiktoken_ext.openai_public
    except ImportError:
        message = "tiktoken is not installed: `pip install -r requirements.txt`"
        raise TokenizerError(message) from None
    if not tokenizer_file:
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:
            # offline: requests' connection errors, or a broken cache
            raise TokenizerError(f"cannot get GPT-2's encoding from tiktoken ({type(e).__name__}); "
                                 f"offline, {TOKENIZER_HINT}") from None
    try:
        # read here, checked first (a pipe would never end): tiktoken's loader keeps a copy of
        # every file it reads, by path, and gives that copy again once the file has changed
        lines = files.read_bytes(tokenizer_file).splitlines()
    except files.FileProblem as e:
        raise TokenizerError(f"--tokenizer {e}") from None
    except OSError as e:
        raise TokenizerError(f"--tokenizer {tokenizer_file}: cannot read it ({e.strerror})") from None
    ranks = {}
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            # a token's bytes in base64, and its rank
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise TokenizerError(f"--tokenizer {tokenizer_file}: not a tiktoken ranks file (line "
                                 f"{number} is not a token in base64 and its rank)") from None
    if len(ranks) != GPT2_RANKS or sorted(ranks.values()) != list(range(GPT2_RANKS)):
        raise TokenizerError(f"--tokenizer {tokenizer_file}: {len(ranks):,} ranks, not GPT-2's "
                             f"{GPT2_RANKS:,} (0 to 50255): the shards' ids would mean other text")
    # the pre-tokenising pattern of tiktoken's own "gpt2" encoding (which shares r50k_base's)
    pattern = tiktoken_ext.openai_public.r50k_pat_str
    encoding = tiktoken.Encoding(name="gpt2", pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": EOT})
    # the right count of ranks, but some token's id another (two swapped, say)
    found = fingerprint(encoding)
    if found != GPT2_FINGERPRINT:
        raise TokenizerError(f"--tokenizer {tokenizer_file}: its ranks are not GPT-2's (fingerprint "
                             f"{found}, not {GPT2_FINGERPRINT}): the shards' ids would mean other "
                             "text; pass GPT-2's own gpt2.tiktoken")
    return encoding


def fingerprint(encoding):
    """What identifies an encoding, for records of what it made: its name and a hash of every
    token's bytes and id."""
    digest = hashlib.sha256()
    for token in sorted(encoding.token_byte_values()):
        token_id = encoding.encode_single_token(token)
        digest.update(len(token).to_bytes(4, "little") + token + token_id.to_bytes(4, "little"))
    for special in sorted(encoding.special_tokens_set):
        special_id = encoding.encode_single_token(special)
        digest.update(special.encode() + special_id.to_bytes(4, "little"))
    return f"{encoding.name} {digest.hexdigest()[:16]}"
