from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = "mlx_lm_mla.pth"


class build_py_with_pth(build_py):
    """Ships mlx_lm_mla.pth at the top of site-packages: Python runs it at
    start-up to activate the fix (see mlx_lm_mla/activate.py)."""

    def run(self):
        super().run()
        self.copy_file(str(here / PTH), str(Path(self.build_lib) / PTH))
        if getattr(self, "editable_mode", False):
            # pip install -e: setuptools puts only install_lib's files (the
            # unpacked wheel) into site-packages, not build_lib's.
            wheel = self.distribution.get_command_obj("install").install_lib
            self.copy_file(str(here / PTH), str(Path(wheel) / PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / PTH)]


here = Path(__file__).parent
version = {}
exec((here / "mlx_lm_mla" / "_version.py").read_text(), version)

# The range of mlx-lm this package is tested against: one place, _version.py.
MLX_LM = "mlx-lm{extra}" + version["MLX_LM_RANGE"]

setup(
    name="mlx-lm-mla",
    version=version["__version__"],
    description="MLA-aware KV caches for mlx-lm: fixes KV quantization, prompt "
    "caching and batching for DeepSeek-V3, GLM-4.7-Flash, Kimi and LongCat models",
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    packages=find_packages(include=["mlx_lm_mla", "mlx_lm_mla.*"]),
    python_requires=">=3.10",
    # packaging reads versions (patches, lmstudio), safetensors checks cache files (patches/files.py)
    install_requires=[
        MLX_LM.format(extra=""),
        "tokenizers",
        "packaging",
        "safetensors",
    ],
    extras_require={
        "cpu": [MLX_LM.format(extra="[cpu]")],
        "cuda12": [MLX_LM.format(extra="[cuda12]")],
        "cuda13": [MLX_LM.format(extra="[cuda13]")],
        # mlx-lm-mla bench --plot
        "plot": ["matplotlib"],
        # requests: mlx-lm's test_server.py; pytest-xdist: the README's test command;
        # ruff: the formatter (its style changes only between minor releases)
        "test": [
            "pytest",
            "pytest-xdist",
            "hypothesis",
            "requests",
            "ruff>=0.17,<0.18",
        ],
    },
    cmdclass={"build_py": build_py_with_pth},
    entry_points={"console_scripts": ["mlx-lm-mla=mlx_lm_mla.__main__:main"]},
)
