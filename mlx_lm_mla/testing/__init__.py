"""The test kit: a fault-injecting server and the README's model table. The runtime
never imports it, and ``lmstudio install`` does not copy it."""
