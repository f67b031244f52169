"""Per shard: the group-commit journal (journal.py), its flush policy (policy.py) and
the two ways a batch is written and fdatasync'ed (syncer.py: io_uring, thread)."""
from bookkeeper.bookie.journal.journal import Journal  # noqa: F401
from bookkeeper.bookie.journal.syncer import make_syncer  # noqa: F401
