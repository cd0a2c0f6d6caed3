"""The upstream form's tests, in mlx-lm's style.

``upstream-patch`` adds the part below each marker line to the named file of
mlx-lm's ``tests/`` (before its ``unittest.main`` block) and the names these
cases use to that file's ``from mlx_lm.models.cache import`` block. They run
only on a patched tree; the imports here let this file be read and linted.
"""

import importlib
import os
import tempfile
import unittest

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    LatentCacheList,
    LatentKVCache,
    QuantizedLatentKVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

# --- upstream: added to tests/test_prompt_cache.py by upstream-patch ---


class TestLatentKVCache(unittest.TestCase):

    def update(self, cache, n):
        latent = mx.random.normal((1, 1, n, 64))
        rope = mx.random.normal((1, 1, n, 16))
        return latent, rope, cache.update_and_fetch(latent, rope)

    def test_to_quantized(self):
        cache = LatentKVCache()
        latent, rope, _ = self.update(cache, 10)
        qcache = cache.to_quantized(group_size=32, bits=8)
        self.assertIsInstance(qcache, QuantizedLatentKVCache)
        # No bits: MLA models attend with the dequantized latent
        self.assertFalse(hasattr(qcache, "bits"))
        self.assertEqual(qcache.offset, 10)
        self.assertLess(qcache.nbytes, cache.nbytes / 2)

        _, new_rope, (k, v) = self.update(qcache, 3)
        self.assertEqual(k.shape, (1, 1, 13, 64))
        self.assertTrue(mx.allclose(k[..., :10, :], latent, atol=0.05))
        # The RoPE key is not quantized
        self.assertTrue(mx.array_equal(v, mx.concatenate([rope, new_rope], axis=2)))

    def test_empty_cache_to_quantized(self):
        qcache = LatentKVCache().to_quantized(group_size=32, bits=4)
        self.assertTrue(qcache.empty())
        self.assertEqual(qcache.nbytes, 0)
        _, rope, (k, v) = self.update(qcache, 5)
        self.assertEqual(k.shape, (1, 1, 5, 64))
        self.assertTrue(mx.array_equal(v, rope))

    def test_trim_quantized_latent_cache(self):
        qcache = QuantizedLatentKVCache(group_size=32, bits=8)
        _, rope, _ = self.update(qcache, 300)
        self.assertEqual(qcache.trim(4), 4)
        _, new_rope, (k, v) = self.update(qcache, 2)
        self.assertEqual(qcache.offset, 298)
        expected = mx.concatenate([rope[..., :296, :], new_rope], axis=2)
        self.assertTrue(mx.array_equal(v, expected))

    def test_save_load_latent_caches(self):
        cache = [LatentKVCache(), QuantizedLatentKVCache(group_size=32, bits=4)]
        cache.append(LatentCacheList(LatentKVCache(), KVCache()).to_quantized(32, 8))
        for c in cache:
            self.update(getattr(c, "caches", [c])[0], 10)
        with tempfile.TemporaryDirectory() as d:
            cache_file = os.path.join(d, "prompt_cache.safetensors")
            save_prompt_cache(cache_file, cache)
            loaded_cache = load_prompt_cache(cache_file)
        self.assertEqual(loaded_cache[1].state[2:], (10, 32, 4))
        for c, lc in zip(cache, loaded_cache):
            self.assertIs(type(lc), type(c))
            # Both continue the same
            c, lc = getattr(c, "caches", [c])[0], getattr(lc, "caches", [lc])[0]
            latent, rope = mx.ones((1, 1, 1, 64)), mx.ones((1, 1, 1, 16))
            for x, y in zip(
                c.update_and_fetch(latent, rope), lc.update_and_fetch(latent, rope)
            ):
                self.assertTrue(mx.array_equal(x, y))

    def test_latent_cache_list_to_quantized(self):
        c = LatentCacheList(LatentKVCache(), KVCache())
        self.update(c[0], 10)
        self.update(c[1], 10)
        qc = c.to_quantized(group_size=32, bits=4)
        self.assertIsInstance(qc, LatentCacheList)
        self.assertIsInstance(qc[0], QuantizedLatentKVCache)
        # A DSA indexer's keys stay exact
        self.assertIs(qc[1], c[1])
        self.assertEqual(qc.offset, 10)


# --- upstream: added to tests/test_models.py by upstream-patch ---


class TestLatentModels(unittest.TestCase):
    # One small config for every MLA model, each reading the fields it has
    CONFIG = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "kv_lora_rank": 64,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        **dict.fromkeys(["n_routed_experts", "num_experts", "group_norm_size"], 4),
        **dict.fromkeys(["num_experts_per_tok", "num_experts_per_token"], 2),
        **dict.fromkeys(["n_shared_experts", "num_shared_experts", "n_group"], 1),
        **dict.fromkeys(["topk_group", "first_k_dense_replace", "moe_layer_freq"], 1),
        "rope_theta": 1000.0,
        "rope_scaling": None,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 256,
        },
        **dict.fromkeys(["max_position_embeddings", "model_max_length"], 256),
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
        "ffn_hidden_size": 128,
        "expert_ffn_hidden_size": 32,
        "moe_topk": 2,
        "zero_expert_num": 2,
        "zero_expert_type": "identity",
        "layer_group_size": 2,
        "linear_attn_config": {
            "kda_layers": [1],
            "full_attn_layers": [2],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        "hidden_act": "situ",
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "attention_method": "MLA",
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "ngram_vocab_size_ratio": 2,
        "emb_neighbor_num": 2,
        "emb_split_num": 2,
    }
    MODEL_TYPES = (
        "bailing_hybrid bailing_moe_v3 deepseek_v3 deepseek_v32 glm4_moe_lite "
        "glm_moe_dsa kimi_k25 kimi_k3 kimi_linear kimi_vl longcat_flash "
        "longcat_flash_ngram mistral4"
    ).split()
    PROMPT = mx.array([[5, 17, 3, 99, 42, 8, 61, 23, 77, 14, 2, 90]])

    def models(self):
        for model_type in self.MODEL_TYPES:
            arch = importlib.import_module(f"mlx_lm.models.{model_type}")
            config = {"model_type": model_type, "text_config": self.CONFIG}
            mx.random.seed(0)
            model = arch.Model(arch.ModelArgs.from_dict({**config, **self.CONFIG}))
            yield model_type, model

    @staticmethod
    def layer_caches(cache):
        return [m for c in cache for m in getattr(c, "caches", [c])]

    def test_mla_models_quantize_the_latent(self):
        from mlx_lm.generate import maybe_quantize_kv_cache

        for model_type, model in self.models():
            with self.subTest(model_type=model_type):
                logits = []
                for bits in [None, 8]:
                    cache = make_prompt_cache(model)
                    model(self.PROMPT[:, :8], cache=cache)
                    maybe_quantize_kv_cache(cache, 0, 32, bits)
                    steps = [
                        model(self.PROMPT[:, i : i + 1], cache=cache)
                        for i in range(8, 12)
                    ]
                    logits.append(mx.concatenate(steps, axis=1))
                caches = self.layer_caches(cache)
                self.assertFalse(any(isinstance(c, LatentKVCache) for c in caches))
                self.assertTrue(
                    any(isinstance(c, QuantizedLatentKVCache) for c in caches)
                )
                self.assertTrue(mx.allclose(logits[0], logits[1], atol=0.05))

    def test_mla_models_honour_max_kv_size(self):
        from mlx_lm.generate import maybe_quantize_kv_cache

        for model_type, model in self.models():
            with self.subTest(model_type=model_type):
                cache = make_prompt_cache(model, max_kv_size=8)
                model(self.PROMPT[:, :10], cache=cache)
                model(self.PROMPT[:, 10:11], cache=cache)
                windows = [c for c in self.layer_caches(cache) if hasattr(c, "keys")]
                self.assertTrue(windows)
                for c in windows:
                    self.assertIsInstance(c, RotatingKVCache)
                    self.assertEqual(c.keys.shape[2], 8)
                # A window is not quantized, as for every model
                with self.assertRaises(NotImplementedError):
                    maybe_quantize_kv_cache(cache, 0, 32, 8)
