# examples/sync_client.py: the blocking twin, the same calls without await
import os

import bookkeeper.sync

METADATA_URI = os.environ.get("BK_METADATA_URI", "zk://127.0.0.1:2181/ledgers")


def main() -> None:
    with bookkeeper.sync.BookKeeper.connect(METADATA_URI) as bk:
        lh = bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=b"secret")
        for i in range(10):
            lh.add_entry(b"entry %d" % i)
        lh.close()
        rh = bk.open_ledger(lh.ledger_id, password=b"secret")
        print(f"ledger {lh.ledger_id}:", [e.data for e in rh.read(0, rh.last_add_confirmed)][:3])


if __name__ == "__main__":
    main()
