"""Log streams: named, unbounded logs over ledgers (DistributedLog's model). See README.md."""
from bookkeeper.stream.namespace import Namespace
from bookkeeper.stream.position import Position
from bookkeeper.stream.reader import StreamReader, StreamRecord
from bookkeeper.stream.writer import StreamWriter, WriterSettings

__all__ = ["Namespace", "Position", "StreamReader", "StreamRecord", "StreamWriter", "WriterSettings"]
