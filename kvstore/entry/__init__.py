"""The self-verifying entry a spill tier stores (docs/FORMAT.md): `format` lays out and
parses its bytes, `codec` encodes and decodes whole entries (payload codecs included), and
`expected` is the hot path for the entries a reader knows exactly (codec "none")."""

from kvstore.entry.codec import decode_entry, encode_entry, payload_bytes
from kvstore.entry.expected import ExpectedEntry
from kvstore.entry.format import (
    CHECKSUM_BYTES,
    CODEC_CODES,
    DAMAGED,
    DTYPE_CODES,
    FIXED_HEADER_BYTES,
    FOREIGN,
    ID_BYTES,
    MISMATCHED,
    REASONS,
    BlockEntry,
    EntryError,
    EntryHeader,
    fixed_entry_bytes,
    max_entry_bytes,
    read_header,
)

__all__ = [
    "CHECKSUM_BYTES",
    "CODEC_CODES",
    "DAMAGED",
    "DTYPE_CODES",
    "FIXED_HEADER_BYTES",
    "FOREIGN",
    "ID_BYTES",
    "MISMATCHED",
    "REASONS",
    "BlockEntry",
    "EntryError",
    "EntryHeader",
    "ExpectedEntry",
    "decode_entry",
    "encode_entry",
    "fixed_entry_bytes",
    "max_entry_bytes",
    "payload_bytes",
    "read_header",
]
