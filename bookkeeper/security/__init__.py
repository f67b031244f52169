"""Security primitives (issue 23): TLS contexts reloaded live and the bookie identity check
(`tls`), `bk1` tokens and their keys (`tokens`), roles per principal (`authz`), AUTH exchange
plug-ins (`auth`), and a small CA for `bk tls` (`pki`). Sans-I/O or file-based: the wire,
the admin HTTP and the tools do the I/O and call these for every decision.

Every reloaded file (certificate, key, CA, token keys, authz) follows `reload.Reloading`'s
rules: a stat at most once per interval, a bad new file keeps the previous one, counted.
"""
