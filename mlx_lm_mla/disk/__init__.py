"""The on-disk tier of the server's prompt caches (``--prompt-cache-dir``).

``folder``: the tier's own folder in DIR, its marker, the names it owns
and its processes' locks; ``fingerprint``: what a cache depends on (the
model's files, the cache settings and layout); ``index``: the SQLite index
of the folder, with the block hashes that find a prompt's longest stored
prefix; ``cachefile``: one cache file, its record and its checksum;
``tier``: lookup, restore, background writes, LRU eviction and the repairs
made at start; ``hooks``: the server's flags and its prompt cache joined to
the tier; ``command``: ``mlx-lm-mla cache-dir stats|clear DIR``.
"""
