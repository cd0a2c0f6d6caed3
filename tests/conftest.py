import os

# Full float32 matmuls on GPUs that run them as TF32 by default (CUDA, Apple
# M5): the tests hold the package's arithmetic to stock's and the cache's
# rounding to upstream's bounds, not TF32's error, as MLX's own tests do. Set
# before MLX's first operation; a value already given wins.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402
from mlx_lm.generate import maybe_quantize_kv_cache  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache  # noqa: E402

import mlx_lm_mla  # noqa: E402
from mlx_lm_mla.activate import disabled  # noqa: E402
from mlx_lm_mla.mla import leaves  # noqa: E402  (layer caches, CacheList members too)

LATENT = 64
ROPE = 16
# The error stock mlx-lm raises for a quantized MLA cache (the reported failure).
SWAPAXES = "'list' object has no attribute 'swapaxes'"


def rows(L, B=1, seed=None, dtype=mx.float32):
    """A random (latent, rope key) update of L tokens for B sequences."""
    if seed is not None:
        mx.random.seed(seed)
    latent = mx.random.normal((B, 1, L, LATENT)).astype(dtype)
    rope = mx.random.normal((B, 1, L, ROPE)).astype(dtype)
    return latent, rope


def filled(cache, L, B=1, seed=0, dtype=mx.float32):
    """cache after one update of L random latent tokens; returns (cache, data)."""
    data = rows(L, B, seed, dtype)
    cache.update_and_fetch(*data)
    return cache, data


def latent_kv(L, seed=0, dtype=mx.float32):
    """A stock KVCache holding L tokens in the MLA latent layout."""
    return filled(KVCache(), L, seed=seed, dtype=dtype)[0]


def step_logits(model, tokens, prefill, bits=None):
    """Logits of one decode step per token of ``tokens`` after a prefill of its
    first ``prefill``, quantizing the cache after the prefill when ``bits`` is
    given."""
    cache = make_prompt_cache(model)
    model(mx.array([tokens[:prefill]]), cache=cache)
    if bits:
        maybe_quantize_kv_cache(
            cache, quantized_kv_start=0, kv_group_size=64, kv_bits=bits
        )
    steps = [model(mx.array([[t]]), cache=cache) for t in tokens[prefill:]]
    return mx.concatenate(steps, axis=1)


def mistral3_of(text_type, seed=0):
    """``(model, config)``: mlx-lm's mistral3 around the tiny ``text_type``
    model, whose config (with its model_type) is mistral3's text_config dict."""
    import copy

    from mlx_lm.utils import _get_classes

    from mlx_lm_mla import tiny

    config = {"model_type": "mistral3", "text_config": tiny.tiny_config(text_type)}
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    mx.eval(model.parameters())
    return model, config


def swap_layers_in_header(raw):
    """A safetensors file's bytes with layer 0's and layer 1's first arrays
    swapped in its header: valid JSON of the same length, a wrong cache."""
    end = 8 + int.from_bytes(raw[:8], "little")
    header = (
        raw[8:end]
        .replace(b'"0.0":{', b'"x.x":{')
        .replace(b'"1.0":{', b'"0.0":{')
        .replace(b'"x.x":{', b'"1.0":{')
    )
    assert header != raw[8:end]
    return raw[:8] + header + raw[end:]


def pytest_configure(config):
    # .ci/run runs the soaks at one leg (-m soak); the README's command does not.
    config.addinivalue_line("markers", "soak: a long soak test")


def left_padded_batch(model, prompts):
    """Each prompt prefilled alone, then the caches merged into one batch (the
    shorter ones left-padded), as BatchGenerator joins rows."""
    caches = []
    for p in prompts:
        c = make_prompt_cache(model)
        model(mx.array([p]), cache=c)
        caches.append(c)
    return [
        BatchKVCache.merge([c[i] for c in caches]) for i in range(len(model.layers))
    ]


@pytest.fixture(autouse=True, scope="module")
def as_in_a_new_process():
    """Each test file starts as a new process would: the fix on, as the start-up
    hook turns it on. pytest-xdist deals the files to its workers in any order,
    after files that may have left it off."""
    if not disabled():
        mlx_lm_mla.install()


@pytest.fixture
def installed():
    """mlx-lm with the fix active, restored afterwards."""
    mlx_lm_mla.install()
    yield
    mlx_lm_mla.uninstall()


@pytest.fixture
def stock():
    """mlx-lm exactly as published: nothing of ours is patched in."""
    mlx_lm_mla.uninstall()
    yield
    mlx_lm_mla.uninstall()


@pytest.fixture
def stock_caches():
    """The cache classes stock mlx-lm gives a model, found with the package
    switched off for the call."""
    from mlx_lm.models.cache import make_prompt_cache

    def classes(model, max_kv_size=None):
        was_installed = bool(mlx_lm_mla.installed())
        mlx_lm_mla.uninstall()
        try:
            return [type(c) for c in leaves(make_prompt_cache(model, max_kv_size))]
        finally:
            if was_installed:
                mlx_lm_mla.install()

    return classes


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """The demo GLM saved as mlx_lm.server loads it, once per module."""
    from serving import save_served_model

    return save_served_model(tmp_path_factory.mktemp("served") / "glm")


@pytest.fixture
def tiers(installed, tmp_path):
    """Opens disk tiers on a folder of the test's (closed at its end)."""
    from disk_child import settings

    from mlx_lm_mla.disk.tier import DiskTier

    opened = []

    def tier(
        max_bytes=1 << 30, changes=None, folder=tmp_path / "caches", min_tokens=64
    ):
        t = DiskTier(folder, max_bytes, {**settings(), **(changes or {})}, min_tokens)
        opened.append(t)
        return t

    yield tier
    for t in opened:
        t.close()
