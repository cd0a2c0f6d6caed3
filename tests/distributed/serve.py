"""``mlx_lm.server`` as a script, for ``mlx.launch`` (which runs a script,
not a module). The arguments are the server's own:

    mlx.launch -n 2 --backend ring --python PYTHON tests/distributed/serve.py \\
        --model MODEL_DIR --pipeline --kv-bits 4 --quantized-kv-start 64

Rank 0 answers HTTP; the other ranks take their part of every step. The fix
comes from the package's start-up hook, as in any process that imports
``mlx_lm`` (``MLX_LM_MLA_DISABLE=1`` leaves stock mlx-lm).
"""

import sys

import mlx_lm.server

if __name__ == "__main__":
    sys.argv[0] = "mlx_lm.server"
    mlx_lm.server.main()
