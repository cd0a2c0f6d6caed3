__version__ = "0.1.0"

# The mlx-lm releases the package is tested with (setup.py, install(), LM Studio).
MLX_LM_RANGE = ">=0.31.2,<0.33"
