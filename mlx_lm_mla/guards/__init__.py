"""Guards on ``mlx_lm.server``, so that no request and no fault leaves the server
worse than a fresh one; ``patches/server.py`` applies them."""
