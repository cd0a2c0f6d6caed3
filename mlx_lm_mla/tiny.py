"""Tiny random-weight models of the installed mlx-lm MLA architectures.

Small configs that keep each architecture's structure (dense first layer, hybrid
layer kinds, sparse indexer, n-gram embedding), seeded weights, a local
character-level tokenizer, written in the layout ``mlx_lm.load`` reads: no download.
"""

import argparse
import contextlib
import copy
import importlib.util
import io
import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten, tree_map, tree_map_with_path
from tokenizers import Tokenizer, decoders, models

from . import mla

VOCAB_SIZE = 256

# The tokenizer's special tokens come first, so their ids are fixed.
SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|endoftext|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# The demo's widths (repro, tiny-model): wide enough that stock KV quantization
# (groups of 64) reaches the model code, where stock fails as reported.
DEMO_WIDTHS = {"kv_lora_rank": 128, "qk_rope_head_dim": 64}
DEMO_WEIGHT_BITS = 6

_MLA_DIMS = {
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}

# DeepSeek V3 style YaRN, so the mscale folded into the attention scale is used.
_YARN = {
    "type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _deepseek_v3():
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 2,
        "topk_group": 1,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 64,
        **_MLA_DIMS,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": dict(_YARN),
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def _deepseek_v32():
    # index_topk below the test prompt lengths, so the sparse path runs.
    return {
        **_deepseek_v3(),
        "index_head_dim": 32,
        "index_n_heads": 8,
        "index_topk": 4,
    }


def _glm_moe_dsa():
    config = _deepseek_v32()
    del config["rope_scaling"], config["rope_theta"]
    return {
        **config,
        "n_group": 1,
        "topk_group": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def _glm4_moe_lite():
    return {
        **_deepseek_v3(),
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "partial_rotary_factor": 1.0,
        "num_nextn_predict_layers": 1,
    }


def _kimi_k2():
    # The DeepSeek V3 text model that Kimi-VL and Kimi K2.5 wrap.
    return {**_deepseek_v3(), "n_group": 1, "topk_group": 1}


def _mistral4():
    config = _deepseek_v3()
    del config["rope_scaling"], config["topk_method"], config["scoring_func"]
    return {
        **config,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "max_position_embeddings": 16,
        # A tiny original context, so the llama-4 query scaling changes
        # within a short prompt.
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    }


def _longcat_flash():
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "expert_ffn_hidden_size": 32,
        "num_layers": 2,
        "num_attention_heads": 4,
        "q_lora_rank": 64,
        **_MLA_DIMS,
        "attention_method": "MLA",
        "n_routed_experts": 8,
        "zero_expert_num": 4,
        "zero_expert_type": "identity",
        "moe_topk": 2,
        "routed_scaling_factor": 6.0,
        "norm_topk_prob": False,
        "router_bias": False,
        # The attention reads these as attributes only when they are true.
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "attention_bias": False,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000000.0,
    }


def _longcat_flash_ngram():
    # 2 * (3 - 1) = 4 n-gram embedders of width 64 / 4 = 16.
    return {
        **_longcat_flash(),
        "ngram_vocab_size_ratio": 4,
        "emb_neighbor_num": 3,
        "emb_split_num": 2,
    }


def _kimi_linear():
    # Three KDA layers, then one MLA layer, as in the real 3:1 pattern.
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        **_MLA_DIMS,
        "mla_use_nope": True,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "model_max_length": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def _kimi_k3():
    config = _kimi_linear()
    del config["head_dim"], config["model_max_length"], config["rope_theta"]
    return {
        **config,
        "q_lora_rank": 64,
        "mla_use_output_gate": True,
        "hidden_act": "situ",
        "attn_res_block_size": 2,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "max_position_embeddings": 4096,
    }


def _bailing_moe_v3():
    # layer_group_size 4: three KDA layers, then one MLA layer.
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "layer_group_size": 4,
        "q_lora_rank": 64,
        **_MLA_DIMS,
        "short_conv_kernel_size": 4,
        "kda_lower_bound": -5.0,
        "kda_safe_gate": True,
        "no_kda_lora": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 6000000.0,
        "rope_interleave": True,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }


def _bailing_hybrid():
    # layer_group_size 4: three lightning-attention layers, then one MLA layer.
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "group_norm_size": 4,
        "use_qk_norm": True,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "score_function": "sigmoid",
        "norm_topk_prob": True,
        "moe_router_enable_expert_bias": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "layer_group_size": 4,
        "q_lora_rank": 64,
        **_MLA_DIMS,
        "rope_interleave": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 6000000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }


def _deepseek_v2():
    # DeepSeek-V2-Lite: no q LoRA, greedy softmax routing.
    config = _deepseek_v3()
    del config["scoring_func"], config["norm_topk_prob"]
    return {
        **config,
        "q_lora_rank": None,
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "rope_scaling": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    }


def _minicpm3():
    # The value head width is hidden_size // num_attention_heads = 16.
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "dim_model_base": 16,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "scale_depth": 1.4,
        "scale_emb": 12,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        # transformers validates one factor per rotated pair.
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [1.0] * 8,
            "original_max_position_embeddings": 32768,
        },
        "tie_word_embeddings": False,
    }


def _youtu_llm():
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        **_MLA_DIMS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1600000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    }


# Models that cache the latent (mla.model_types).
_MLA_CONFIGS = {
    "deepseek_v3": _deepseek_v3,
    "deepseek_v32": _deepseek_v32,
    "glm_moe_dsa": _glm_moe_dsa,
    "glm4_moe_lite": _glm4_moe_lite,
    "kimi_vl": _kimi_k2,
    "kimi_k25": _kimi_k2,
    "mistral4": _mistral4,
    "longcat_flash": _longcat_flash,
    "longcat_flash_ngram": _longcat_flash_ngram,
    "kimi_linear": _kimi_linear,
    "kimi_k3": _kimi_k3,
    "bailing_moe_v3": _bailing_moe_v3,
    "bailing_hybrid": _bailing_hybrid,
}

# MLA-style projections that cache full per-head keys and values.
_FULL_KV_CONFIGS = {
    "deepseek_v2": _deepseek_v2,
    "minicpm3": _minicpm3,
    "youtu_llm": _youtu_llm,
}

# Stand-ins for the hub models mlx-lm's own tests load (see write_hub_stand_in).
_STAND_IN_CONFIGS = {
    "qwen2": lambda: {
        # head width 64, so mlx-lm's tests can quantize the cache in groups of 64
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB_SIZE,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    # Multi-query attention: one KV head, like an MLA latent cache has.
    "llama": lambda: {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": VOCAB_SIZE,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
}

# Vision-language wrappers that read the language model from text_config.
_NESTED = ("kimi_vl", "kimi_k25")
# Wrappers whose text_config names the language model they build: its own
# config, with its model_type.
_WRAPPED = {"mistral3": "mistral4"}

# transformers reads config.json when it loads the tokenizer, and otherwise
# fills in the real models' token ids, which fall outside the tiny vocab.
_TOKEN_IDS = {
    "bos_token_id": None,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": EOS_TOKEN_ID,
}


def _installed(model_type: str) -> bool:
    return importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None


MLA_MODEL_TYPES = tuple(mla.installed_model_types())
FULL_KV_MODEL_TYPES = tuple(t for t in _FULL_KV_CONFIGS if _installed(t))


def tiny_config(model_type: str, **overrides) -> dict:
    """A small config.json dict for ``model_type``; ``overrides`` replace keys of
    the language model config (under ``text_config`` for the VL wrappers)."""
    if model_type in _WRAPPED:
        inner = _WRAPPED[model_type]
        if model_type not in MLA_MODEL_TYPES:  # mlx-lm 0.31's mistral3: no mistral4
            raise ValueError(
                f"This mlx-lm's {model_type} does not build a {inner} language model"
            )
        text = tiny_config(inner, **overrides)
        return {"model_type": model_type, "text_config": text, **_TOKEN_IDS}
    make = (
        _MLA_CONFIGS.get(model_type)
        or _FULL_KV_CONFIGS.get(model_type)
        or _STAND_IN_CONFIGS.get(model_type)
    )
    if make is None:
        raise ValueError(f"No tiny config for model type {model_type!r}")
    config = {**make(), **_TOKEN_IDS, **overrides}
    if model_type in _NESTED:
        config = {"text_config": config, **_TOKEN_IDS}
    return {"model_type": model_type, **config}


def _randomize_zeros(model: nn.Module):
    # mlx-lm starts MoE routers and score biases at zero, which makes every
    # expert tie. Random values make routing decisive and exercise the biases.
    def fill(v):
        if mx.issubdtype(v.dtype, mx.floating) and not mx.any(v).item():
            return (0.1 * mx.random.normal(v.shape)).astype(v.dtype)
        return v

    model.update(tree_map(fill, model.parameters()))


def _cast(model: nn.Module, dtype: mx.Dtype):
    # Like mlx_lm.convert: keep what the model's cast_predicate excludes
    # (e.g. e_score_correction_bias) in its original precision.
    predicate = getattr(model, "cast_predicate", lambda _: True)

    def cast(path, v):
        if mx.issubdtype(v.dtype, mx.floating) and predicate(path):
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(cast, model.parameters()))


def _mlx_lm_utils():
    """``mlx_lm.utils``, once the names read from it are as expected."""
    import mlx_lm.utils

    from .patches.contract import unmet
    from .patches.table import TINY

    problems = unmet(TINY)
    if problems:
        found = "; ".join(f"{label}: {why}" for label, why in problems.items())
        raise RuntimeError(
            f"mlx-lm-mla cannot build tiny models with this mlx-lm: {found}"
        )
    return mlx_lm.utils


def build_model(
    model_type: str, seed: int = 0, dtype: mx.Dtype = mx.float32, **overrides
) -> tuple[nn.Module, dict]:
    """``(model, config)`` of the installed mlx-lm class; a seed gives its weights."""
    config = tiny_config(model_type, **overrides)
    model_class, model_args_class = _mlx_lm_utils()._get_classes(config)
    mx.random.seed(seed)
    model = model_class(model_args_class.from_dict(copy.deepcopy(config)))
    _randomize_zeros(model)
    _cast(model, dtype)
    mx.eval(model.parameters())
    model.eval()
    return model, config


def save_model(
    path,
    model_type: str,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    quantize_bits: Optional[int] = None,
    group_size: int = 64,
    **overrides,
) -> Path:
    """Writes ``build_model``'s model where ``mlx_lm.load`` reads it back (with the
    index ``sharded_load`` reads), quantized by mlx-lm if ``quantize_bits``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, config = build_model(model_type, seed, dtype, **overrides)
    if quantize_bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = _mlx_lm_utils().quantize_model(
                model, config, group_size=group_size, bits=quantize_bits
            )
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(
        str(path / "model.safetensors"), weights, metadata={"format": "mlx"}
    )
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": {name: "model.safetensors" for name in sorted(weights)},
    }
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)
    with open(path / "config.json", "w") as f:
        json.dump(config, f, indent=4)
    write_tokenizer(path)
    return path


def save_demo_model(path, model_type="glm4_moe_lite", seed=0):
    """The report's set-up in small: an MLA model at the demo's widths with
    6-bit weights, its tokenizer and chat template, for ``mlx_lm.server``."""
    widths = dict(DEMO_WIDTHS)
    if "index_head_dim" in tiny_config(model_type):
        # The sparse-attention indexer ropes that many of its own head's values.
        widths["index_head_dim"] = 2 * widths["qk_rope_head_dim"]
    return save_model(path, model_type, seed, quantize_bits=DEMO_WEIGHT_BITS, **widths)


def write_hub_stand_in(hub_dir, repo_id="mlx-community/Qwen1.5-0.5B-Chat-4bit"):
    """A tiny random 4-bit Qwen2 in a Hugging Face hub cache, under repo_id,
    so tests that load that model run offline (``HF_HUB_OFFLINE=1`` with
    ``HF_HUB_CACHE=hub_dir``). Returns the snapshot folder."""
    repo = Path(hub_dir) / ("models--" + repo_id.replace("/", "--"))
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return save_model(repo / "snapshots" / revision, "qwen2", quantize_bits=4)


def write_tokenizer(path) -> None:
    """A character-level tokenizer in ``VOCAB_SIZE`` ids: the special tokens, tab,
    newline, printable ASCII and Latin-1; any other character is ``<unk>``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    chars = ["\t", "\n"] + [chr(c) for c in [*range(32, 127), *range(161, 256)]]
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + chars)}
    # BPE without merges splits the text into single characters.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(path / "tokenizer.json"))

    special_tokens = {
        "eos_token": EOS_TOKEN,
        "unk_token": "<unk>",
        "pad_token": EOS_TOKEN,
        "additional_special_tokens": SPECIAL_TOKENS[2:],
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config, f, indent=4)
    with open(path / "special_tokens_map.json", "w") as f:
        json.dump(special_tokens, f, indent=4)


def load(path):
    return mlx_lm.load(str(path))


def _seed(text):
    """A seed mx.random.seed takes: a whole number from 0 to 2**64 - 1."""
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2**64:
        raise argparse.ArgumentTypeError(
            f"expected a whole number from 0 to 2**64 - 1, got {text!r}"
        )
    return seed


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="mlx-lm-mla tiny-model",
        description="Write a tiny random-weight MLA model, with a tokenizer and "
        "chat template, that mlx_lm.load and mlx_lm.server load offline.",
    )
    parser.add_argument("dir", help="a new or empty folder")
    parser.add_argument(
        "--model-type",
        default="glm4_moe_lite",
        choices=MLA_MODEL_TYPES,
        metavar="TYPE",
        help="its architecture: %(choices)s (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=_seed, default=0, help="seed of its random weights (default: 0)"
    )
    args = parser.parse_args(argv)
    path = Path(args.dir)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        parser.error(f"{path} exists and is not an empty folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way, a read-only file system
        parser.error(f"cannot make the folder {path}: {e.strerror or e}")
    save_demo_model(path, args.model_type, args.seed)
    print(
        f"wrote a tiny random {args.model_type} ({DEMO_WEIGHT_BITS}-bit weights) "
        f"to {path}\nserve it: mlx_lm.server --model {path} --kv-bits 4 "
        "--quantized-kv-start 64"
    )
    return 0
