"""One rank of a distributed run, started by ``mlx.launch``:

    mlx.launch -n 2 --backend ring --python PYTHON tests/distributed/ranks.py \\
        OUT {pipeline,tensor} MODEL_DIR[=SCENARIO,...] ...

For each model, each rank first runs its share of the scenarios on the whole
model, loaded with ``mlx_lm.load`` as one process would (the reference), then
the scenarios (all of them, or those named) on the model sharded over all ranks with
``mlx_lm.utils.sharded_load`` (pipeline or tensor parallel). Greedy decoding
throughout. It writes what it saw to ``OUT/rank<r>.json`` after every
scenario, so a run that breaks still says how far it got. A scenario that
raises records the error. If every rank raised (stock mlx-lm fails in the
same layer everywhere) the ranks go on to the next scenario; if only some
did, they end with status 1 and ``mlx.launch`` stops the others, which may
be waiting on them.

The fix is whatever the process has: the package's start-up hook turns it on
when ``mlx_lm`` is imported, ``MLX_LM_MLA_DISABLE=1`` leaves stock mlx-lm.
"""

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator, generate_step, generation_stream
from mlx_lm.models.cache import CacheList, make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import sharded_load

import mlx_lm_mla
from mlx_lm_mla.testing.replay import generated

START = 48  # quantized_kv_start: the first request of a reuse scenario crosses it
GROUP = 64
WINDOW = 40  # max_kv_size of the rolling-window scenario
MAX_TOKENS = 6
PREFIX = [(3 * i + 11) % 190 + 5 for i in range(30)]
# A first request past START, then two that share its first 30 tokens.
REQUESTS = [PREFIX + [(5 * j + 2) % 190 + 5 for j in range(26)]] + [
    PREFIX + [(7 * r + j) % 190 + 5 for j in range(3 + 4 * r)] for r in range(2)
]
BATCH_PROMPTS = [[(3 * i + 5 * n) % 190 + 5 for i in range(n)] for n in (5, 17, 9, 12)]
BATCH_MAX_TOKENS = [2, 7, 4, 1]  # the rows finish at different steps


def leaves(cache):
    for c in cache:
        if isinstance(c, CacheList):
            yield from leaves(c.caches)
        else:
            yield c


def offset(cache):
    return next(leaves(cache)).offset


def holdings(cache):
    """What this rank's prompt cache holds."""
    return {
        "layers": len(cache),
        "bytes": sum(c.nbytes for c in leaves(cache)),
        "classes": sorted({type(c).__name__ for c in leaves(cache)}),
        "positions": sorted(
            {c.keys.shape[2] for c in leaves(cache) if c.keys is not None}
        ),
    }


def generate(model, cache, prompt, bits):
    return generated(model, cache, prompt, MAX_TOKENS, bits, START, GROUP)


def reuse(model, bits):
    """Requests as a server serves them from one prompt cache: trim it to the
    prefix shared with what it holds, process the rest."""
    cache = make_prompt_cache(model)
    history, tokens, reused = [], [], []
    for prompt in REQUESTS:
        common = 0
        while (
            common < min(len(history), len(prompt) - 1)
            and history[common] == prompt[common]
        ):
            common += 1
        trim_prompt_cache(cache, offset(cache) - common)
        out = generate(model, cache, prompt[common:], bits)
        history = (prompt + out)[: offset(cache)]
        tokens.append(out)
        reused.append(common)
    return {"tokens": tokens, "reused": reused, **holdings(cache)}


def window(model):
    """A rolling window: two requests in a row, the first longer than it."""
    cache = make_prompt_cache(model, max_kv_size=WINDOW)
    tokens = [generate(model, cache, p, 4) for p in REQUESTS[:2]]
    return {"tokens": tokens, **holdings(cache)}


def batch(model):
    """BatchGenerator over rows that finish at different steps."""
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(BATCH_PROMPTS, BATCH_MAX_TOKENS)
    got, finished_at, step = {u: [] for u in uids}, {}, 0
    while responses := gen.next_generated():
        step += 1
        for r in responses:
            got[r.uid].append(r.token)
            if r.finish_reason is not None:
                finished_at[r.uid] = step
    gen.close()
    return {
        "tokens": [got[u] for u in uids],
        "finished_at": [finished_at.get(u) for u in uids],
    }


def alone(model):
    """The batch's rows, each generated on its own."""
    return {
        "tokens": [
            [t for t, _ in generate_step(mx.array(p), model, max_tokens=n)]
            for p, n in zip(BATCH_PROMPTS, BATCH_MAX_TOKENS)
        ]
    }


SCENARIOS = {
    "reuse_kv4": lambda m: reuse(m, 4),
    "reuse_kv8": lambda m: reuse(m, 8),
    "window_kv4": window,
    "batch": batch,
}
# What one process computes to compare with, where it is not the scenario itself.
REFERENCE = {"batch": alone}


def attempt(scenario, model):
    """The scenario's result, or the error it raised."""
    try:
        return scenario(model)
    except Exception as e:
        return {
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }


def failures(failed):
    """How many ranks failed the scenario just run. Every rank waits here for
    the others, so none exits while another still evaluates a step it takes
    part in."""
    # generate_step evaluates a step ahead: let its collectives finish first,
    # or they and this sum interleave on the ring
    mx.synchronize(generation_stream)
    mx.synchronize()
    return mx.distributed.all_sum(mx.array(int(failed)), stream=mx.cpu).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("mode", choices=["pipeline", "tensor"])
    p.add_argument("models", nargs="+", help="MODEL_DIR or MODEL_DIR=SCENARIO,...")
    args = p.parse_args()

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    report = {
        "rank": rank,
        "size": size,
        "mode": args.mode,
        "fix_installed": bool(mlx_lm_mla.installed()),
        "results": {},
        "references": {},
        "done": False,
    }
    path = Path(args.out) / f"rank{rank}.json"

    def write():
        path.write_text(json.dumps(report, indent=1))

    started = time.perf_counter()
    write()
    for spec in args.models:
        model_dir, _, only = spec.partition("=")
        names = only.split(",") if only else list(SCENARIOS)
        whole, _, config = mlx_lm.load(model_dir, return_config=True)
        report.setdefault("total_layers", {})[config["model_type"]] = len(whole.layers)
        keys = [f"{config['model_type']}/{name}" for name in names]
        for i, (key, name) in enumerate(zip(keys, names)):
            if i % size == rank:  # the ranks share the one-process runs
                report["references"][key] = attempt(
                    REFERENCE.get(name, SCENARIOS[name]), whole
                )
        del whole
        groups = {f"{args.mode}_group": group}
        model, _ = sharded_load(model_dir, **groups)
        for key, name in zip(keys, names):
            report["results"][key] = attempt(SCENARIOS[name], model)
            write()
            if failures("error" in report["results"][key]) not in (0, size):
                sys.exit(1)  # the ranks no longer run the same steps
    report["done"] = True
    report["seconds"] = time.perf_counter() - started
    write()


if __name__ == "__main__":
    main()
