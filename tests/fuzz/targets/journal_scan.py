"""The journal's block scan (scan_blocks in ext/bookkeeper/_ext/journal.pyx, what
Journal.replay runs over each journal file): a file image after a crash, a torn write or a
damaged disk.

Input: one byte choosing the file's generation (format 2) or none (format 1), then the image
from its first block. Properties: the scan returns, never raises; it ends inside the image
on a block boundary; scanning only the bytes it accepted gives the same records and no torn
tail (what replay applied does not depend on what followed); a next valid block is past the
end, on a block boundary, and only ever reported after a torn block. Anything else (an
exception, an over-read under ASan) is a crash.
"""
from __future__ import annotations

from bookkeeper._ext.journal import BLOCK_ALIGN, REC_ADD, REC_FENCE, REC_MASTER_KEY, JournalBatch, scan_blocks

GENERATION = 0x1234


def one_input(data: bytes) -> None:
    if not data:
        return
    generation = GENERATION if data[0] & 1 else -1
    image = data[1:]
    records, end, torn, last_seq, next_valid = scan_blocks(image, 0, generation)
    assert 0 <= end <= max(len(image), 0) + BLOCK_ALIGN and end % BLOCK_ALIGN == 0, f"end {end}"
    assert (last_seq == -1) == (end == 0), f"last_seq {last_seq} at end {end}"
    if next_valid >= 0:
        assert torn and next_valid > end and (next_valid - end) % BLOCK_ALIGN == 0, f"next_valid {next_valid}"
    again = scan_blocks(image[:end], 0, generation)
    assert again[:4] == (records, end, False, last_seq), "the accepted prefix scans differently"
    for rtype, _, _, _ in records:  # feedback for atheris
        if rtype == REC_ADD:
            pass
        elif rtype == REC_FENCE:
            pass


def _block(seq: int, records: list[tuple[int, int, int, bytes]]) -> bytes:
    batch = JournalBatch()
    for rtype, ledger_id, entry_id, data in records:
        batch.add(rtype, ledger_id, entry_id, data)
    return bytes(batch.seal(seq))


def seeds() -> list[bytes]:
    gen = GENERATION << 32
    adds = [(REC_ADD, 7, e, b"entry %d" % e) for e in range(5)]
    two = _block(gen, [(REC_MASTER_KEY, 7, -1, bytes(20))] + adds) + _block(gen + 1, [(REC_FENCE, 7, -1, b"")])
    return [
        b"\x01" + _block(gen, adds),
        b"\x01" + two,
        b"\x00" + _block(5, adds[:2]),
        b"\x01" + two[:BLOCK_ALIGN] + bytes(64),
        b"\x01" + _block(gen, adds) + _block((GENERATION + 1) << 32, adds[:1]),
    ]
