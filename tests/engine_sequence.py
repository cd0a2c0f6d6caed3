"""The sequential path of LM Studio's MLX engines, in public mlx-lm calls only.

``make_prompt_cache(model, max_kv_size)``, a common-prefix
``trim_prompt_cache``, a chunked prefill that quantizes a *copy* of the cache
list, then ``generate_step``. Plain mlx-lm (no pytest, no mlx_lm_mla), so
``tests/test_callers.py`` imports it and ``tests/test_lmstudio.py`` runs it as
a script in an LM Studio layer's isolated interpreter:

    python -I engine_sequence.py MODEL_DIR   # prints one JSON line
"""

import json
import logging
import sys

if __name__ == "__main__":
    # A host that shows Python's logs, set up before mlx_lm is imported (when the fix logs).
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )

import mlx.core as mx
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import (
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

START = 32  # quantized_kv_start
CHUNK = 16  # prefill step

HISTORY = [(3 * i + 11) % 190 + 5 for i in range(30)]


def chat(n):
    """A growing chat: each request repeats the last one and adds a turn."""
    return [
        HISTORY + [(7 * r + j) % 190 + 5 for r in range(k + 1) for j in range(5)]
        for k in range(n)
    ]


class SequentialEngine:
    """What the engine's sequential path does for each request."""

    def __init__(self, model, window, bits):
        self.model, self.window, self.bits = model, window, bits
        self.cache = make_prompt_cache(model, window)
        self.tokens = []

    def quantize(self, caches):
        maybe_quantize_kv_cache(caches, START, 64, self.bits)

    def request(self, prompt, max_tokens=6):
        common = 0
        while (
            common < min(len(self.tokens), len(prompt) - 1)
            and self.tokens[common] == prompt[common]
        ):
            common += 1
        held = self.cache[0].offset
        if held > common and not (
            can_trim_prompt_cache(self.cache)
            and trim_prompt_cache(self.cache, held - common)
        ):
            self.cache, common = make_prompt_cache(self.model, self.window), 0
        rest = prompt[common:]
        while len(rest) > CHUNK:
            self.model(mx.array([rest[:CHUNK]]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.quantize(list(self.cache))  # a copy of the list, as the engine does
            rest = rest[CHUNK:]
        out = [
            t
            for t, _ in generate_step(
                mx.array(rest),
                self.model,
                prompt_cache=self.cache,
                max_tokens=max_tokens,
                kv_bits=self.bits,
                kv_group_size=64,
                quantized_kv_start=START,
            )
        ]
        self.tokens = (prompt + out)[: self.cache[0].offset]
        return out


def serve(model_path, requests=6, bits=4):
    """The engine with KV-cache quantization on (it drops the window then),
    serving a growing chat; what it served and the first error."""
    import mlx_lm

    model, _ = mlx_lm.load(model_path)
    engine = SequentialEngine(model, None, bits)
    served, errors = 0, []
    for prompt in chat(requests):
        try:
            served += len(engine.request(prompt)) > 0
        except Exception as e:  # a failed request; the engine goes on to the next
            errors.append(f"{type(e).__name__}: {e}")
    patch = sys.modules.get(
        "mlx_lm_mla.patches"
    )  # only the start-up hook can have loaded it
    return {
        "served": served,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "patched": len(patch.installed()) if patch else 0,
        "cache": type(engine.cache[0]).__name__,
    }


if __name__ == "__main__":
    print(json.dumps(serve(sys.argv[1])))
