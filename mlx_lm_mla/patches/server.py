"""Patches on ``mlx_lm.server``, applied when it is imported: the guards, batching
of MLA models under ``--kv-bits``, and the disk tier."""

import sys

from ..disk import hooks as disk
from ..guards import recovery, requests, reuse, sampling
from ..guards.state import serving
from ..mla import has_latent_attention
from .generate import GENERATE, KVSettings, quantizing_next
from .table import (
    BAD_REQUESTS,
    DISK,
    KV_BATCHING,
    RECOVERY,
    REQUEST_CHECKS,
    REUSE,
    SAMPLING,
    Patch,
)

SERVER = "mlx_lm.server"
CACHE = "mlx_lm.models.cache"


def table():
    server = sys.modules[SERVER]
    handler, generator = "APIHandler", "ResponseGenerator"
    fetch, insert = "LRUPromptCache.fetch_nearest_cache", "LRUPromptCache.insert_cache"
    return [
        Patch(
            SERVER,
            f"{handler}.handle_completion",
            "wrap",
            requests.guarded_completion,
            REQUEST_CHECKS,
        ),
        # One wrapper of _tokenize: the request's checks, then its cache policy.
        Patch(
            SERVER,
            f"{generator}._tokenize",
            "wrap",
            lambda f: reuse.no_store_tokenize(requests.checked_tokenize(f, server)),
            REQUEST_CHECKS,
        ),
        Patch(
            SERVER,
            f"{handler}._set_completion_headers",
            "wrap",
            requests.bad_request_status,
            BAD_REQUESTS,
        ),
        Patch(
            SERVER,
            f"{handler}.validate_model_parameters",
            "wrap",
            requests.refused_parameters,
            BAD_REQUESTS,
        ),
        Patch(
            SERVER, f"{handler}.do_POST", "wrap", requests.answered_post, BAD_REQUESTS
        ),
        # The server batches MLA models under --kv-bits; BatchGenerator quantizes.
        Patch(
            SERVER,
            f"{generator}._is_batchable",
            "wrap",
            batchable_with_kv_bits,
            KV_BATCHING,
        ),
        # BatchGenerator._next finds the server's --kv-bits from its loop.
        Patch(SERVER, f"{generator}._generate", "wrap", serving, KV_BATCHING),
        Patch(GENERATE, "BatchGenerator._next", "wrap", quantizing_next, KV_BATCHING),
        Patch(CACHE, fetch, "wrap", reuse.guarded_fetch, REUSE),
        Patch(CACHE, insert, "wrap", reuse.guarded_insert, REUSE),
        # The disk tier, behind RAM: it sees what the guards let through. The
        # LRUPromptCache finds its server's tier from the server's loop.
        Patch(SERVER, f"{generator}._generate", "wrap", serving, DISK),
        Patch(CACHE, fetch, "wrap", disk.fetch_from_disk, DISK),
        Patch(CACHE, insert, "wrap", disk.insert_to_disk, DISK),
        Patch(SERVER, "run", "wrap", disk.with_tier, DISK),
        # A model's files are fingerprinted as its weights are loaded.
        Patch(SERVER, "ModelProvider.load", "wrap", disk.fingerprinted_load, DISK),
        # main() makes its parser through this module global: the flags join it,
        # and --kv-bits's help says what the package changes.
        Patch(SERVER, "argparse", "set", disk.server_argparse, DISK),
        Patch(SERVER, "argparse", "set", kv_bits_help, KV_BATCHING),
        Patch(
            SERVER,
            f"{generator}._next_request",
            "wrap",
            recovery.tracked_next_request,
            RECOVERY,
        ),
        Patch(
            SERVER,
            f"{generator}._generate",
            "wrap",
            recovery.supervised_generate,
            RECOVERY,
        ),
        # The samplers find their request's state in the server of their loop.
        Patch(SERVER, f"{generator}._generate", "wrap", serving, SAMPLING),
        Patch(SERVER, "_make_sampler", "wrap", sampling.guarded_make_sampler, SAMPLING),
        Patch(
            SERVER,
            "_make_logits_processors",
            "wrap",
            sampling.guarded_make_logits_processors,
            SAMPLING,
        ),
    ]


KV_BITS_NOTE = (
    " With mlx-lm-mla, MLA models keep batching: their latents are quantized in "
    "the batch."
)


def kv_bits_help(original):
    """``mlx_lm.server``'s ``argparse``, whose parser's ``--kv-bits`` help adds
    that MLA models keep batching (stock's says it turns batching off)."""

    class Parser(original.ArgumentParser):
        def parse_known_args(self, args=None, namespace=None):
            for action in self._actions:  # parse_args and --help come here
                text = (action.help or "").rstrip()
                if action.dest == "kv_bits" and KV_BITS_NOTE not in text:
                    end = "" if text.endswith(".") or not text else "."
                    action.help = text + end + KV_BITS_NOTE
            return super().parse_known_args(args, namespace)

    return disk.argparse_with(original, Parser)


def batchable_with_kv_bits(original):
    """``ResponseGenerator._is_batchable`` that batches MLA models under
    ``--kv-bits``: upstream's quantized cache cannot batch, a latent batch can."""

    def _is_batchable(self, args):
        if original(self, args):
            return True
        model = self.model_provider.model
        return (
            KVSettings.of(self.cli_args) is not None
            and model is not None
            and args.seed is None
            and self.model_provider.is_batchable
            and has_latent_attention(model)
        )

    _is_batchable.mlx_lm_mla_original = original
    return _is_batchable
