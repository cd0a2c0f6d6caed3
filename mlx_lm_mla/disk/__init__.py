"""The on-disk tier of the server's prompt caches (``--prompt-cache-dir``)."""
