"""install() / uninstall(): idempotent, reversible, version checked."""

import importlib
import warnings

import mlx_lm.generate
import mlx_lm.models.cache as upstream_cache
import mlx_lm.models.deepseek_v3 as deepseek_v3
import mlx_lm.models.deepseek_v32 as deepseek_v32
import pytest

import mlx_lm_mla
from mlx_lm_mla import MLALatentCache, patch, tiny


def test_install_registers_classes_where_load_prompt_cache_looks(stock):
    patched = mlx_lm_mla.install()
    assert upstream_cache.MLALatentCache is MLALatentCache
    assert "mlx_lm.models.cache.BatchMLALatentCache" in patched


def test_install_hooks_every_mla_model_class(stock):
    mlx_lm_mla.install()
    for model_type in tiny.MLA_MODEL_TYPES:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
        # own hook, or inherited from the class it builds on (glm_moe_dsa)
        assert hasattr(module.Model.make_cache, "mlx_lm_mla_original"), model_type


def test_install_is_idempotent(stock):
    first = mlx_lm_mla.install()
    hook = deepseek_v3.Model.__dict__["make_cache"]
    assert mlx_lm_mla.install() == first
    assert deepseek_v3.Model.__dict__["make_cache"] is hook


def test_uninstall_restores_everything(stock):
    own = deepseek_v32.Model.__dict__["make_cache"]
    make_cache = getattr(mlx_lm.generate, "_make_cache", None)
    mlx_lm_mla.install()
    restored = mlx_lm_mla.uninstall()
    assert restored and mlx_lm_mla.installed() == []
    assert "make_cache" not in deepseek_v3.Model.__dict__
    assert deepseek_v32.Model.__dict__["make_cache"] is own
    assert getattr(mlx_lm.generate, "_make_cache", None) is make_cache
    assert not hasattr(upstream_cache, "MLALatentCache")


def test_uninstalled_models_get_stock_caches_again(stock):
    model, _ = tiny.build_model("glm4_moe_lite")
    mlx_lm_mla.install()
    assert isinstance(upstream_cache.make_prompt_cache(model)[0], MLALatentCache)
    mlx_lm_mla.uninstall()
    assert type(upstream_cache.make_prompt_cache(model)[0]) is upstream_cache.KVCache


def test_the_installed_mlx_lm_is_in_the_supported_range():
    assert patch.is_supported(), mlx_lm.__version__


def test_outside_the_supported_range_it_warns_once(stock, monkeypatch):
    monkeypatch.setattr(patch, "SUPPORTED_MLX_LM", ((0, 1, 0), (0, 2, 0)))
    monkeypatch.setattr(patch, "_warned", False)
    with pytest.warns(RuntimeWarning, match="tested with mlx-lm 0.1.0"):
        mlx_lm_mla.install()
    mlx_lm_mla.uninstall()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mlx_lm_mla.install()  # no second warning
