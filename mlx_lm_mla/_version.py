__version__ = "0.1.0"

# The mlx-lm releases this package is tested with, as a pip specifier:
# setup.py, install() and the LM Studio installer all read it from here.
MLX_LM_RANGE = ">=0.31.2,<0.33"
