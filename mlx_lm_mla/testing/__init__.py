"""The test kit: a fault-injecting server (``faults``) and the README's model
table (``model_table``). The runtime never imports it, and
``mlx-lm-mla lmstudio install`` does not copy it. The tiny models it and the
tests build are the runtime's own (``mlx_lm_mla.tiny``): ``repro`` and
``tiny-model`` use them too."""
