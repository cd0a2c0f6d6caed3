"""The package's on/off environment switches (``MLX_LM_MLA_DISABLE``,
``MLX_LM_MLA_CUDA_KERNEL``): the words each takes, read in one place."""

import os

ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch(name, default):
    """The environment's switch ``name``: True, False, ``default`` where unset
    or empty, or None where it is none of ON and OFF."""
    word = os.environ.get(name, "").strip().lower()
    if not word:
        return default
    return True if word in ON else False if word in OFF else None
