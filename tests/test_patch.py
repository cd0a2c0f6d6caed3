"""install() / uninstall(): idempotent, reversible, version checked."""

import warnings

import mlx.core as mx
import mlx_lm.generate
import mlx_lm.models.cache as upstream_cache
import mlx_lm.models.deepseek_v3 as deepseek_v3
import pytest

import mlx_lm_mla
from mlx_lm_mla import QuantizedLatentCache, patches


def test_install_registers_classes_where_load_prompt_cache_looks(stock):
    patched = mlx_lm_mla.install()
    assert upstream_cache.QuantizedLatentCache is QuantizedLatentCache
    assert "mlx_lm.models.cache.BatchQuantizedLatentCache" in patched
    assert "mlx_lm.models.cache.QuantizedRotatingLatentCache" in patched


def test_install_touches_only_the_mla_attention_of_model_modules(stock):
    from mlx_lm_mla import mla

    mlx_lm_mla.install()
    calls = {f"{c.__module__}.{c.__qualname__}.__call__" for c in mla.ATTENTION}
    decode = {f"{c.__module__}.scaled_dot_product_attention" for c in mla.ATTENTION}
    in_models = {
        label
        for label in mlx_lm_mla.installed()
        if label.startswith("mlx_lm.models.")
        and not label.startswith("mlx_lm.models.cache.")
    }
    # A chunk over a longer latent knows its expansions where they are made.
    made = {
        f"mlx_lm.models.mla.{c}.__call__"
        for c in ("MultiLinear", "QuantizedMultiLinear")
    }
    assert calls and in_models == calls | decode | made
    assert "make_cache" not in deepseek_v3.Model.__dict__


def test_install_is_idempotent(stock):
    first = mlx_lm_mla.install()
    hook = upstream_cache.KVCache.__dict__["to_quantized"]
    assert mlx_lm_mla.install() == first
    assert upstream_cache.KVCache.__dict__["to_quantized"] is hook


def test_uninstall_restores_everything(stock):
    originals = {
        cls: dict(vars(cls))
        for cls in (
            upstream_cache.KVCache,
            upstream_cache.RotatingKVCache,
            upstream_cache.BatchKVCache,
        )
    }
    mlx_lm_mla.install()
    restored = mlx_lm_mla.uninstall()
    assert restored and mlx_lm_mla.installed() == []
    assert all(dict(vars(cls)) == attrs for cls, attrs in originals.items())
    assert not hasattr(upstream_cache, "QuantizedLatentCache")


def test_uninstalled_caches_quantize_as_stock_again(stock):
    def latent():
        c = upstream_cache.KVCache()
        c.update_and_fetch(mx.zeros((1, 1, 4, 64)), mx.zeros((1, 1, 4, 32)))
        return c

    mlx_lm_mla.install()
    assert type(latent().to_quantized(32, 4)) is QuantizedLatentCache
    mlx_lm_mla.uninstall()
    assert type(latent().to_quantized(32, 4)) is upstream_cache.QuantizedKVCache


def test_the_installed_mlx_lm_is_in_the_supported_range():
    assert patches.is_supported(), mlx_lm.__version__


def test_outside_the_supported_range_it_warns_once(stock, monkeypatch):
    monkeypatch.setattr(patches, "MLX_LM_RANGE", ">=0.1.0,<0.2.0")
    monkeypatch.setattr(patches, "_warned", False)
    with pytest.warns(RuntimeWarning, match="tested with mlx-lm 0.1.0"):
        mlx_lm_mla.install()
    mlx_lm_mla.uninstall()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mlx_lm_mla.install()  # no second warning


def test_no_patch_is_missing_at_this_mlx_lm(stock):
    import mlx_lm.server  # noqa: F401 (its guards are applied with it)

    mlx_lm_mla.install()
    assert patches.missing() == []
    assert "mlx_lm.server.APIHandler.handle_completion" in mlx_lm_mla.installed()


def test_a_patch_whose_target_is_gone_is_named_and_warned_once(stock, monkeypatch):
    from mlx_lm.server import ResponseGenerator

    monkeypatch.delattr(ResponseGenerator, "_is_batchable")
    monkeypatch.setattr(patches, "_warned_missing", set())
    with pytest.warns(RuntimeWarning, match=r"ResponseGenerator\._is_batchable"):
        mlx_lm_mla.install()
    assert patches.missing() == ["mlx_lm.server.ResponseGenerator._is_batchable"]
    mlx_lm_mla.uninstall()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mlx_lm_mla.install()  # no second warning
    assert patches.missing() == ["mlx_lm.server.ResponseGenerator._is_batchable"]


def test_uninstall_restores_what_a_module_imported_since_copied(stock, monkeypatch):
    import sys
    import types

    original = upstream_cache.make_prompt_cache
    mlx_lm_mla.install()
    # As `from mlx_lm.models.cache import make_prompt_cache` in a module that
    # mlx-lm imports later (mlx_lm.server, mlx_lm.chat, mlx_lm.cache_prompt).
    late = types.ModuleType("mlx_lm._imported_since")
    late.make_prompt_cache = upstream_cache.make_prompt_cache
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert late.make_prompt_cache is not original
    restored = mlx_lm_mla.uninstall()
    assert late.make_prompt_cache is original
    assert "mlx_lm._imported_since.make_prompt_cache" in restored


def apply_failing_at(monkeypatch, n, module=None):
    """Patches apply until the ``n``-th (of ``module``'s rows, if given),
    which raises; returns the rows counted."""
    counted, apply = [], patches._apply

    def failing(patch, planned):
        if module is None or patch.module == module:
            counted.append(patch)
            if len(counted) == n:
                raise RuntimeError("a patch that cannot be applied")
        apply(patch, planned)

    monkeypatch.setattr(patches, "_apply", failing)
    return counted


def test_server_patches_that_fail_are_taken_back_and_the_import_goes_on(
    stock, monkeypatch
):
    import mlx_lm.server

    from mlx_lm_mla.patches import server as server_patches

    def target(row):
        path, _, name = row.target.rpartition(".")
        return patches._owner(mlx_lm.server, path), name

    rows = [r for r in server_patches.table() if r.module == mlx_lm.server.__name__]
    stock_values = [vars(owner).get(name) for owner, name in map(target, rows)]
    applied = apply_failing_at(monkeypatch, 4, module=mlx_lm.server.__name__)
    with pytest.warns(RuntimeWarning, match="could not apply its mlx_lm.server"):
        mlx_lm_mla.install()  # mlx_lm.server is imported: its rows apply now
    # The three it applied are taken back: the server is as published.
    assert len(applied) == 4 and patches._server == []
    assert [vars(owner).get(name) for owner, name in map(target, rows)] == (
        stock_values
    )
    labels = {f"{r.module}.{r.target}" for r in server_patches.table()}
    assert labels and not labels & set(mlx_lm_mla.installed())


def test_a_patch_whose_module_is_gone_is_named_and_its_feature_switched_off(stock):
    from mlx_lm_mla.patches.table import Patch

    mlx_lm_mla.install()
    gone = Patch("mlx_lm.no_such_module", "make", "wrap", lambda f: f, "gone")
    patches.apply_table([gone])
    assert "mlx_lm.no_such_module.make" in patches.missing()
    assert "gone" in patches._off


def test_an_install_that_fails_partway_takes_back_what_it_applied(stock, monkeypatch):
    stock_attrs = dict(vars(upstream_cache.KVCache))
    calls = apply_failing_at(monkeypatch, 5)
    with pytest.raises(RuntimeError, match="cannot be applied"):
        mlx_lm_mla.install()
    assert len(calls) == 5 and mlx_lm_mla.installed() == []
    assert dict(vars(upstream_cache.KVCache)) == stock_attrs
