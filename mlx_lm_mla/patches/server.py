"""Patches on ``mlx_lm.server``, applied when it is imported: the guards
(``guards/``) on its HTTP side, its generation loop and its shared prompt
cache, batching of MLA models under ``--kv-bits``, and the prompt caches'
disk tier (``disk/``, ``--prompt-cache-dir``)."""

import sys

from ..disk import hooks as disk
from ..guards import recovery, requests, reuse, sampling
from ..mla import has_latent_attention
from .table import Patch
from .generate import BATCH_QUANTIZING, SERVER_KV, KVSettings

SERVER = "mlx_lm.server"
CACHE = "mlx_lm.models.cache"
_LRU = tuple(f"{CACHE}.LRUPromptCache.{n}" for n in ("_trie", "_lru", "_n_bytes", "_n_bytes_by_type"))
_TOKENIZE = (
    f"{SERVER}.ResponseGenerator._tokenize",
    f"{SERVER}._make_sampler",
    f"{SERVER}._make_logits_processors",
    "mlx_lm.tokenizer_utils.TokenizerWrapper._tokenizer",
)
_LOOP = tuple(f"{SERVER}.ResponseGenerator.{n}" for n in ("_next_request", "_generate", "_stop"))


def table():
    server = sys.modules[SERVER]
    return [
        Patch(SERVER, "APIHandler.handle_completion", "wrap", requests.guarded_completion,
              needs=("http.server.BaseHTTPRequestHandler._headers_buffer",),
              feature="request checks"),
        Patch(SERVER, "APIHandler._set_completion_headers", "wrap", requests.bad_request_status,
              needs=(f"{SERVER}.APIHandler._set_completion_headers",), feature="400 for bad requests"),
        Patch(SERVER, "APIHandler.validate_model_parameters", "wrap", requests.refused_parameters),
        Patch(SERVER, "APIHandler.do_POST", "wrap", requests.answered_post),
        Patch(SERVER, "ResponseGenerator._is_batchable", "wrap", batchable_with_kv_bits,
              needs=(f"{SERVER}.ResponseGenerator._is_batchable", *BATCH_QUANTIZING),
              feature="--kv-bits batching of MLA models"),
        Patch(SERVER, "ResponseGenerator._generate", "wrap", generate_with_kv_settings,
              needs=(f"{SERVER}.ResponseGenerator._is_batchable", *BATCH_QUANTIZING),
              feature="--kv-bits batching of MLA models"),
        # One wrapper of _tokenize: the request's checks, then its cache policy.
        Patch(SERVER, "ResponseGenerator._tokenize", "wrap",
              lambda f: reuse.no_store_tokenize(requests.checked_tokenize(f, server)),
              needs=_TOKENIZE, feature="request checks"),
        Patch(CACHE, "LRUPromptCache.fetch_nearest_cache", "wrap", reuse.guarded_fetch,
              needs=_LRU, feature="prompt cache reuse guards"),
        Patch(CACHE, "LRUPromptCache.insert_cache", "wrap", reuse.guarded_insert,
              needs=_LRU, feature="prompt cache reuse guards"),
        # The disk tier, behind RAM: it sees what the guards let through.
        Patch(CACHE, "LRUPromptCache.fetch_nearest_cache", "wrap", disk.fetch_from_disk,
              feature="prompt caches on disk"),
        Patch(CACHE, "LRUPromptCache.insert_cache", "wrap", disk.insert_to_disk,
              feature="prompt caches on disk"),
        Patch(SERVER, "run", "wrap", disk.with_tier, feature="prompt caches on disk"),
        # main() makes its parser through this module global: the tier's flags join it.
        Patch(SERVER, "argparse", "set", disk.server_argparse,
              needs=(f"{SERVER}.argparse",), feature="prompt caches on disk"),
        # The loop is supervised only where the open requests can be tracked.
        Patch(SERVER, "ResponseGenerator._next_request", "wrap", recovery.tracked_next_request,
              needs=_LOOP, feature="recovery after a failure"),
        Patch(SERVER, "ResponseGenerator._generate", "wrap", recovery.supervised_generate,
              needs=_LOOP, feature="recovery after a failure"),
        Patch(SERVER, "_make_sampler", "wrap", sampling.guarded_make_sampler,
              needs=(f"{SERVER}._make_sampler",), feature="sampling guards"),
        Patch(SERVER, "_make_logits_processors", "wrap", sampling.guarded_make_logits_processors,
              needs=(f"{SERVER}._make_logits_processors",), feature="sampling guards"),
    ]


def batchable_with_kv_bits(original):
    """``ResponseGenerator._is_batchable`` that keeps batching MLA models when
    ``--kv-bits`` is set. Upstream refuses, since its quantized cache cannot
    batch; a latent batch can, each row quantized once its own length
    reaches ``--quantized-kv-start`` (``generate.quantizing_next``). Other
    models keep upstream behaviour."""

    def _is_batchable(self, args):
        if original(self, args):
            return True
        model = getattr(self.model_provider, "model", None)
        return (
            KVSettings.of(self.cli_args) is not None
            and model is not None
            and args.seed is None
            and self.model_provider.is_batchable
            and has_latent_attention(model)
        )

    _is_batchable.mlx_lm_mla_original = original
    return _is_batchable


def generate_with_kv_settings(original):
    """``ResponseGenerator._generate`` (the generation thread) with the
    server's ``--kv-bits`` settings in ``generate.SERVER_KV`` for the
    BatchGenerators it runs."""

    def _generate(self):
        token = SERVER_KV.set(KVSettings.of(getattr(self, "cli_args", None)))
        try:
            return original(self)
        finally:
            SERVER_KV.reset(token)

    _generate.mlx_lm_mla_original = original
    return _generate
