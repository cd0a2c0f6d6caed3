"""The on-disk tier of the server's prompt caches (``--prompt-cache-dir``).

``fingerprint``: what a cache depends on (the model's files, the cache
settings and layout); ``index``: the SQLite index of the directory;
``files``: one cache file, written atomically and checked when read;
``tier``: lookup, restore, background writes and LRU eviction; ``hooks``:
the server's flags and its prompt cache joined to the tier.
"""
