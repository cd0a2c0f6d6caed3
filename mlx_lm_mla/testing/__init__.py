"""The test kit: tiny random-weight models of the real MLA architectures
(``tiny``), a fault-injecting server (``faults``) and the README's model
table (``model_table``). The runtime never imports it, and
``mlx-lm-mla lmstudio install`` does not copy it."""
