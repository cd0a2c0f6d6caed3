"""The measured figures the docs quote, rendered from the benchmarks' JSON.

Every benchmark writes ``benchmarks/results/NAME.json`` (git-ignored). The
runs the docs quote are kept in ``benchmarks/figures/NAME.json``
(committed), and each quoted table sits in a doc between two markers:

    <!-- figures: NAME [TABLE] -->
    | ... |
    <!-- /figures -->

which hold this script's rendering of that JSON; a figure quoted in a
sentence sits between ``<!-- figure: NAME TABLE -->`` and ``<!-- /figure -->``
on one line. ``tests/test_figures.py`` checks every marked table and figure
against its JSON.

    python benchmarks/figures.py keep NAME [PATH]   # a run's JSON into figures/
    python benchmarks/figures.py                    # then rewrite the marked tables
"""

import argparse
import json
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "benchmarks" / "figures"
DOCS = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
BLOCK = re.compile(r"<!-- figures: (\w+)(?: (\w+))? -->\n(.*?)<!-- /figures -->", re.S)
INLINE = re.compile(r"<!-- figure: (\w+) (\w+) -->(.*?)<!-- /figure -->")
MIB = 2**20


def rows_table(header, rows):
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    return (
        "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows]) + "\n"
    )


def run_line(data):
    v = data["versions"]
    commit = data.get("git", {}).get("commit") or v.get("worktree_head")
    device = v.get("device", "Device(cpu, 0)")
    return (
        f"Run: {commit}, mlx {v['mlx']}, mlx-lm {v['mlx_lm']}, {device}, {v['machine']}, "
        f"load average {data.get('load_average_1min_at_end', 0):.1f} at its end; `{data['command']}`.\n"
    )


VARIANTS = {"stock": "stock bf16", "ours": "bf16", "ours8": "8-bit", "ours4": "4-bit"}


def variant(row):
    # Runs since mlx_lm_mla/bench.py name each variant in the row.
    return row.get("label") or VARIANTS[row["variant"]]


def decode_speed(data, table=None):
    """Whole-model decode (default; ``targets``: the rows that have one) or
    one layer's attention (``attention``)."""
    if table == "attention":
        header = ["context", "batch", "variant", "ms", "x stock", "floor MB", "GB/s"]
        # A share of the memory's peak where the run's GPU told it (CUDA).
        peak = data.get("device", {}).get("peak_gb_per_s")
        header += ["% of peak"] if peak else []
        rows = [
            (
                f"{r['context']:,}",
                r["batch"],
                variant(r),
                # A GPU's step is well under a millisecond.
                f"{r['ms']:.1f}" if r["ms"] >= 1 else f"{r['ms']:.3g}",
                f"{r['speed']:.2f}",
                f"{r['floor_mb']:.1f}",
                f"{r['gb_per_s']:.2f}",
            )
            + ((f"{r['peak_percent']:.1f}",) if peak else ())
            for r in data["attention_rows"]
        ]
    else:
        header = [
            "context",
            "batch",
            "variant",
            "tokens/s",
            "x stock",
            "transient MiB/layer",
            "target",
        ]
        rows = [
            (
                f"{r['context']:,}",
                r["batch"],
                variant(r),
                f"{r['tokens_per_s']:.2f}",
                f"{r['ratio']:.2f}",
                f"{r['transient_mib']:.1f}",
                f">= {r['target']:.1f}: {'met' if r['met'] else 'missed'}"
                if "target" in r
                else "-",
            )
            for r in data["decode_rows"]
            if table != "targets" or (r["context"], r["batch"]) in _with_targets(data)
        ]
    return rows_table(header, rows) + "\n" + run_line(data)


def _with_targets(data):
    return {(r["context"], r["batch"]) for r in data["decode_rows"] if "target" in r}


def peak_memory(data, table=None):
    header = [
        "variant",
        "peak",
        "cache",
        "transient",
        "decode transient",
        "target",
        "result",
    ]
    rows = []
    for r in data["rows"]:
        per = {k: (None if v is None else v / MIB) for k, v in r["per_layer"].items()}
        fmt = lambda x: "-" if x is None or r["error"] else f"{x:.1f}"  # noqa: E731
        target = "-" if r["met"] is None else ("met" if r["met"] else "missed")
        result = r["error"] or f"`{', '.join(r['classes'])}`"
        rows.append(
            (
                r["variant"],
                fmt(per["peak"]),
                fmt(per["cache"]),
                fmt(per["transient"]),
                fmt(per["decode_transient"]),
                target,
                result,
            )
        )
    return rows_table(header, rows) + "\n" + run_line(data)


def mixed_batch_memory(data, table=None):
    header = ["rows quantized", "cache", "MiB per layer", "against all exact"]
    rows = [
        (
            f"{r['quantized']} of {data['args']['rows']}",
            f"`{r['cls']}`",
            f"{r['bytes'] / MIB:.2f}",
            f"{r['ratio']:.2f}",
        )
        for r in data["rows"]
    ]
    return rows_table(header, rows) + "\n" + run_line(data)


def bytes_per_token(data, table=None):
    """Whole-model bytes per token at 4,096 tokens (default), the DSA models
    (``dsa``) or each rank under mlx.launch (``ranks``)."""
    if table == "dsa":
        header = [
            "model",
            "latent",
            "latent bytes/token",
            "indexer",
            "total",
            "of unquantized",
        ]
        rows = [
            (
                r["model"],
                r["latent"].replace(" (stock)", ""),
                f"{r['latent_per_token']:,.0f}",
                f"{r['indexer_per_token']:,.0f}",
                f"{r['total_per_token']:,.0f}",
                f"{r['of_unquantized']:.3f}",
            )
            for r in data["dsa"]
        ]
    elif table == "ranks":
        header = [
            "model",
            "cache",
            "parallel",
            "ranks",
            "layers per rank",
            "largest rank",
            "smallest rank",
        ]
        rows = [
            (
                r["model"],
                r["cache"],
                r["parallel"],
                r["ranks"],
                r["layers_per_rank"],
                f"{r['largest_rank']:,.0f}",
                f"{r['smallest_rank']:,.0f}",
            )
            for r in data["per_rank"]
        ]
    elif table == "layer":  # quoted in a sentence: one layer at GLM-4.7-Flash's widths
        per_layer = {
            r["cache"].split()[-1]: r["bytes_per_token"] / r["layers"]
            for r in data["single"]
            if r["model"] == "GLM-4.7-Flash" and r["tokens"] == 4096
        }
        return (
            f"{per_layer['(stock)']:,.0f} bytes per token per MLA layer unquantized, "
            f"{per_layer['8-bit']:,.0f} at 8 bits and {per_layer['4-bit']:,.0f} at 4 bits"
        )
    else:
        header = ["model", "cache", "bytes/token", "floor", "held / floor", "layout"]
        rows = [
            (
                r["model"],
                r["cache"],
                f"{r['bytes_per_token']:,.0f}",
                f"{r['floor_per_token']:,.0f}",
                f"{r['held_ratio']:.4f}",
                r["note"],
            )
            for r in data["single"]
            if r["tokens"] == 4096
        ]
    return rows_table(header, rows) + "\n" + run_line(data)


def rope_precision(data, table=None):
    header = ["bits", "RoPE key", "max abs logit difference", "bytes/token/layer"]
    rows = [
        (
            r["bits"] or "-",
            ("quantized" if r["quantize_rope"] else "bfloat16")
            if r["bits"]
            else "unquantized",
            f"{r['max_logit_diff']:.4f}" if r["bits"] else "0",
            f"{r['bytes_per_token_layer']:,.0f}",
        )
        for r in data["rows"]
    ]
    return rows_table(header, rows) + "\n" + run_line(data)


def _tracebacks(summary):
    found = summary["server_exceptions"]
    if not found:
        return "0"
    return f"{found['count']}: " + ", ".join(f"`{e}`" for e in found["distinct"])


def soak_server(data, table=None):
    """Each server's summary of the soak, a column a server."""
    summary = data["summary"]
    heads = {
        "ours": "with mlx-lm-mla",
        "stock": f"stock mlx-lm {data['versions']['mlx_lm']}",
    }

    def num(v, spec):
        return "-" if v is None else format(v, spec)

    figures = [
        ("requests served", lambda s: f"{s['served']} / {s['requests']}"),
        ("errors", lambda s: str(s["errors"])),
        ("first error at request", lambda s: num(s["first_error_index"], "d")),
        ("tracebacks in its log", _tracebacks),
        (
            "latency p50 / p95 (s)",
            lambda s: (
                f"{num(s['latency_p50'], '.3f')} / {num(s['latency_p95'], '.3f')}"
            ),
        ),
        ("cached-token ratio", lambda s: num(s["cached_ratio"], ".3f")),
        ("completion tokens", lambda s: f"{s['completion_tokens']:,}"),
        ("peak memory VmHWM (MiB)", lambda s: num(s.get("vmhwm", 0) / MIB, ".0f")),
    ]
    rows = [(name, *(cell(summary[k]) for k in summary)) for name, cell in figures]
    return (
        rows_table(["figure", *(heads[k] for k in summary)], rows)
        + "\n"
        + run_line(data)
    )


FORMS = ["release", "patch 1", "patches 1 and 2"]


def _outcome(r):
    """A served or batched row's cell: what it kept, or why it failed."""
    if r["result"] == "ok":
        return f"ok, {r['bytes_ratio']:.2f}"
    text = r["result"].split(":")[0] if ":" in r["result"] else r["result"]
    return text if len(text) <= 40 else text[:37] + "..."


def upstream_form(data, table=None):
    """The upstream form's figures by tree: ``served`` (default), ``batched``,
    ``fidelity``, ``layer``, ``model``, ``requantized``, ``decode``."""
    runs = data["runs"]
    forms = [f for f in FORMS if f in runs]
    last = runs[forms[-1]]  # the figures every patched tree gives alike
    if table in (None, "batched"):
        key = "served" if table is None else "batched"
        header = ["model", *forms]
        by_model = {r["model"]: {} for r in runs[forms[0]][key]}
        for f in forms:
            for r in runs[f][key]:
                by_model[r["model"]][f] = r
        rows = [
            (f"`{m}`", *(_outcome(rs[f]) for f in forms)) for m, rs in by_model.items()
        ]
        if table is None:
            header.append("tokens held, `max_kv_size=64`")
            rows = [
                (*row, " / ".join(str(by_model[m][f]["window"]) for f in forms))
                for row, m in zip(rows, by_model)
            ]
    elif table == "fidelity":
        header = ["model", "8 bits", "4 bits"]
        rows = [
            (f"`{r['model']}`", f"{r['bits8']:.4f}", f"{r['bits4']:.4f}")
            for r in last["fidelity"]
        ]
    elif table == "layer":
        header = ["latent", "bytes a token", "a decode step beyond the cache (MiB)"]
        rows = [
            (
                f"{r['bits']}-bit" if r["bits"] else "exact",
                f"{r['bytes_per_token']:,.0f}",
                f"{r['step'] / MIB:.1f}",
            )
            for r in last["one_layer"]
        ]
    elif table == "model":
        header = ["layers", "latent", "cache (MiB)", "a decode step beyond it (MiB)"]
        rows = [
            (
                r["layers"],
                f"{r['bits']}-bit" if r["bits"] else "exact",
                f"{r['cache'] / MIB:.1f}",
                f"{r['step'] / MIB:.1f}",
            )
            for r in last["model_step"]
        ]
    elif table == "requantized":
        dtypes = list(dict.fromkeys(r["dtype"] for r in last["requantized"]))
        header = ["bits", *dtypes]
        moved = {(r["bits"], r["dtype"]): r["moved"] for r in last["requantized"]}
        rows = [
            (b, *(f"{moved[b, d]:.0%}" for d in dtypes))
            for b in dict.fromkeys(r["bits"] for r in last["requantized"])
        ]
    elif table == "decode":
        patched = [f for f in forms if "decode_ratio" in runs[f]]
        header = ["model", *patched]
        rows = [
            (
                f"`{r['model']}`",
                *(f"{runs[f]['decode_ratio'][i]['ratio']:.2f}" for f in patched),
            )
            for i, r in enumerate(runs[patched[0]]["decode_ratio"])
        ]
    else:
        raise ValueError(f"upstream_form has no table {table!r}")
    v = data["versions"]
    trees = "; ".join(f"{f} at {runs[f]['git']['commit']}" for f in forms)
    return (
        rows_table(header, rows)
        + "\n"
        + f"Runs: {trees}; mlx {v['mlx']}, mlx-lm {v['mlx_lm']}, {v['device']}, "
        f"{v['machine']}; `MLX_LM_MLA_DISABLE=1 [PYTHONPATH=TREE] python "
        f"benchmarks/upstream_form.py --json`.\n"
    )


def fidelity(data, table=None):
    header = [
        "model",
        "positions read",
        "8-bit median",
        "8-bit max",
        "4-bit median",
        "4-bit max",
    ]
    rows = [
        (
            f"`{r['model']}`",
            r["read"],
            f"{r['median8']:.4f}",
            f"{r['max8']:.4f}",
            f"{r['median4']:.4f}",
            f"{r['max4']:.4f}",
        )
        for r in data["rows"]
    ]
    return rows_table(header, rows) + "\n" + run_line(data)


def disk_ttft(data, table=None):
    """Every prompt size (default) or the largest (``largest``)."""
    largest = max(e["size"] for e in data["results"])
    header = [
        "model",
        "prompt chars",
        "prompt tokens",
        "restored tokens",
        "cold TTFT s",
        "warm TTFT s",
        "warm / cold",
        "disk B/token/layer",
    ]
    rows = [
        (
            e["variant"],
            f"{e['size']:,}",
            f"{e['prompt_tokens_warm']:,}",
            f"{e['cached_tokens_warm']:,}",
            f"{e['ttft_cold']:.2f}",
            f"{e['ttft_warm']:.2f}",
            f"{100 * e['warm_over_cold']:.1f} %",
            f"{e['bytes_per_token_per_layer']:,.0f}",
        )
        for e in data["results"]
        if table != "largest" or e["size"] == largest
    ]
    return rows_table(header, rows) + "\n" + run_line(data)


def disk_lookup(data, table=None):
    """Lookup time against rows (default), or the TTFT of an unrelated prompt (``ttft``)."""
    if table == "ttft":
        header = ["server", "TTFT s (median)", "requests", "cached tokens, most"]
        rows = [
            (e["variant"], f"{e['ttft_median_s']:.3f}", e["n"], e["max_cached_tokens"])
            for e in data["ttft"]
        ]
    else:
        header = [
            "rows",
            "tokens / row",
            "index MB",
            "lookup ms: unrelated",
            "system prompt",
            "half a row",
            "check at start s",
        ]
        rows = [
            (
                f"{e['rows']:,}",
                f"{e['tokens_per_row']:,}",
                f"{e['index_mb']:.0f}",
                f"{e['lookup_ms_unrelated']:.2f}",
                f"{e['lookup_ms_system_prompt']:.2f}",
                f"{e['lookup_ms_half_a_row']:.2f}",
                f"{e['check_at_start_s']:.2f}",
            )
            for e in data["lookup"]
        ]
    return rows_table(header, rows) + "\n" + run_line(data)


def disk_fingerprint(data, table=None):
    """The model digest's cost by model size, sparse and real files."""
    header = ["files", "GiB", "shards", "MiB read", "cold ms", "warm ms"]
    rows = [
        (
            r["files"],
            f"{r['gib']:g}",
            r["shards"],
            f"{r['read_mib']:.1f}",
            "-" if r["cold_ms"] is None else f"{r['cold_ms']:.0f}",
            f"{r['warm_ms']:.0f}",
        )
        for r in data["rows"]
    ]
    return rows_table(header, rows) + "\n" + run_line(data)


def next_turn(data, table=None):
    header = ["variant", "TTFT s", "x stock", "transient MiB/layer", "x stock"]
    rows = [
        (
            r["label"],
            f"{r['ttft_s']:.2f}",
            f"{r['ratio']:.2f}",
            f"{r['transient_mib']:.1f}",
            f"{r['transient_ratio']:.2f}",
        )
        for r in data["rows"]
    ]
    return rows_table(header, rows) + "\n" + run_line(data)


def disk_sigterm(data, table=None):
    """Seconds from SIGTERM to the end of a server in a long prefill."""
    header = ["server", "path", "exit s (median)", "largest", "prefilled, most", "done"]
    rows = [
        (
            r["variant"],
            r["path"],
            f"{r['median_s']:.2f}",
            f"{r['max_s']:.2f}",
            f"{r['processed_at_end_max']:,} / {r['prompt_tokens']:,}",
            r["finished"],
        )
        for r in data["rows"]
    ]
    return rows_table(header, rows) + "\n" + run_line(data)


def disk_index(data, table=None):
    """A start and a write's index time against rows; the start that halves."""
    header = [
        "rows",
        "tokens / row",
        "index MB",
        "start ms",
        "index ms per write",
    ]
    rows = [
        (
            f"{e['rows']:,}",
            f"{e['tokens_per_row']:,}",
            f"{e['index_mb']:.0f}",
            f"{1e3 * e['start_s']:.1f}",
            f"{e['write_index_ms']:.1f}",
        )
        for e in data["results"]
    ]
    h = data["halve"]
    return (
        rows_table(header, rows)
        + f"\nA start that halves the bound at {h['rows']:,} rows: listening after "
        f"{h['start_s']:.2f} s, its eviction done after {h['evicted_s']:.1f} s "
        f"({h['files_left']:,} files left).\n\n" + run_line(data)
    )


def cpu_rule(data, table=None):
    """The fold against stock's attention on the same bf16 cache at short
    contexts: one layer's attention (default) or the whole model (``model``)."""
    if table == "model":
        kind, key, ratio, unit = "decode_rows", "tokens_per_s", "ratio", "tokens/s"
    else:
        kind, key, ratio, unit = "attention_rows", "ms", "speed", "ms"
    got = {(r["context"], r["batch"], r["variant"]): r for r in data[kind]}
    header = ["positions", "batch", f"stock {unit}", f"fold {unit}", "fold x stock"]
    rows = [
        (
            f"{c:,}",
            b,
            f"{got[c, b, 'stock'][key]:.2f}",
            f"{r[key]:.2f}",
            f"{r[ratio]:.2f}",
        )
        for (c, b, v), r in got.items()
        if v == "ours"
    ]
    settings = ", ".join(f"{k}={v}" for k, v in data.get("settings", {}).items())
    return (
        rows_table(header, rows)
        + f"\nSettings: {settings or 'none'}. "
        + run_line(data)
    )


RENDER = {
    "cpu_rule": cpu_rule,
    "disk_fingerprint": disk_fingerprint,
    "disk_index": disk_index,
    "disk_lookup": disk_lookup,
    "disk_sigterm": disk_sigterm,
    "disk_ttft": disk_ttft,
    "bytes_per_token": bytes_per_token,
    "decode_speed": decode_speed,
    "fidelity": fidelity,
    "fidelity_tf32": fidelity,
    "mixed_batch_memory": mixed_batch_memory,
    "next_turn": next_turn,
    "peak_memory": peak_memory,
    "rope_precision": rope_precision,
    "soak_server": soak_server,
    "upstream_form": upstream_form,
}


def render(name, table=None):
    path = FIGURES / f"{name}.json"
    if not path.is_file():
        raise SystemExit(
            f"{path.relative_to(ROOT)} is not kept: run the benchmark, then figures.py keep {name}"
        )
    return RENDER[name](json.loads(path.read_text()), table)


def blocks(text):
    """(name, table, rendered text in the doc) of each marked table and figure."""
    return [
        (m.group(1), m.group(2), m.group(3))
        for pattern in (BLOCK, INLINE)
        for m in pattern.finditer(text)
    ]


def rewrite(path):
    text = path.read_text(encoding="utf-8")

    def fill(m):
        return f"<!-- figures: {m.group(1)}{' ' + m.group(2) if m.group(2) else ''} -->\n{render(m.group(1), m.group(2))}<!-- /figures -->"

    def fill_inline(m):
        return f"<!-- figure: {m.group(1)} {m.group(2)} -->{render(m.group(1), m.group(2))}<!-- /figure -->"

    new = INLINE.sub(fill_inline, BLOCK.sub(fill, text))
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    keep = sub.add_parser("keep", help="copy a run's JSON into benchmarks/figures/")
    keep.add_argument("name", choices=sorted(RENDER))
    keep.add_argument("path", nargs="?", help="default: benchmarks/results/NAME.json")
    args = p.parse_args(argv)
    if args.command == "keep":
        source = (
            Path(args.path)
            if args.path
            else ROOT / "benchmarks" / "results" / f"{args.name}.json"
        )
        if not source.is_file():
            p.error(f"keep {args.name}: no run to keep at {source}")
        FIGURES.mkdir(exist_ok=True)
        shutil.copyfile(source, FIGURES / f"{args.name}.json")
        return
    for doc in DOCS:
        if rewrite(doc):
            print(f"rewrote {doc.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
