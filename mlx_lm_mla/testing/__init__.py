"""The test kit: a fault-injecting server, the README's model table, and requests
replayed as a server reuses its cache. The runtime never imports it, and
``lmstudio install`` does not copy it."""
