"""The bookie: a supervisor process and one shard process per core.

  supervisor.py  supervisor only: cookie check, shard processes, ZooKeeper registration, admin HTTP
  shard.py       per shard: process entry point, wiring storage + journal + server
  server.py      per shard: the uvloop RPC front end (request dispatch)
  journal/       per shard: group-commit journal, io_uring and thread syncers
  storage/       per shard: entry log + LMDB index + durable ledger state
"""
