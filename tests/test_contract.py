"""The contract (patches/contract.py): every mlx-lm name the package reads
holds at this mlx-lm, and one that does not, of each kind, is named in
missing() and in one log line, and switches off its feature alone."""

import argparse
import dataclasses
import importlib
import logging
import re
import types
import warnings

import mlx_lm
import pytest

import mlx_lm_mla
from mlx_lm_mla import patches
from mlx_lm_mla.patches import contract
from mlx_lm_mla.patches.table import (
    CACHE_CHECKS,
    DISK,
    EVERYTHING,
    KV_BATCHING,
    QUANTIZE,
    RECOVERY,
    REQUEST_CHECKS,
    REUSE,
    TINY,
)


def table_rows():
    """Every row of the patch table at this mlx-lm (read while installed:
    the model rows fill what install() fills)."""
    from mlx_lm_mla.patches import files, generate, models, quantize, server

    core = [*quantize.table(), *models.table(), *files.table(), *generate.table()]
    return core + server.table()


def label(patch):
    return f"{patch.module}.{patch.target}"


def features_on():
    return set(patches.features_on())


@pytest.fixture
def server(stock, monkeypatch):
    """mlx_lm.server imported, so install() applies its patches too; every
    name warned about again."""
    server = importlib.import_module("mlx_lm.server")
    monkeypatch.setattr(patches, "_warned_missing", set())
    return server


@pytest.fixture
def all_features(server):
    mlx_lm_mla.install()
    found = {p.feature for p in table_rows()}
    mlx_lm_mla.uninstall()
    return found


def install_logged(caplog):
    """install(), and the features its one log line names as switched off."""
    with caplog.at_level(logging.WARNING, logger="mlx_lm_mla"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mlx_lm_mla.install()
    [line] = [r.getMessage() for r in caplog.records if r.name == "mlx_lm_mla"]
    return re.search(r"switched off: (.*)$", line).group(1).split(", "), line


def assert_only_off(feature, all_features, caplog, name):
    off, line = install_logged(caplog)
    assert name in patches.missing() and name in line
    assert off == [feature]
    assert features_on() == all_features - {feature}


# --- every row holds where it should ----------------------------------------


def test_every_name_of_the_contract_holds_at_this_mlx_lm(server):
    rows = [row for row in contract.rows() if contract.applies(row)]
    problems = {row.label: contract.problem(row) for row in rows}
    assert problems == {row.label: None for row in rows}


def test_a_name_of_a_later_mlx_lm_is_checked_from_that_release_on(monkeypatch):
    later = [row for row in contract.NAMES if row.since]
    assert later
    monkeypatch.setattr(mlx_lm, "__version__", "0.31.9")
    assert not any(contract.applies(row) for row in later)
    monkeypatch.setattr(mlx_lm, "__version__", "0.32.0")
    assert all(contract.applies(row) for row in later)


def test_every_name_is_read_by_a_feature_of_the_patch_table(all_features):
    read = {feature for row in contract.rows() for feature in row.features}
    assert read <= all_features | {EVERYTHING, TINY}


def test_no_feature_is_applied_partly_at_install_and_partly_with_the_server(server):
    from mlx_lm_mla.patches import server as server_patches

    mlx_lm_mla.install()
    later = server_patches.table()
    first = table_rows()[: -len(later)]
    assert later and not {p.feature for p in later} & {p.feature for p in first}


def wrapper(self, group_size=64, bits=4):
    """A replacement taking exactly these."""


@pytest.mark.parametrize(
    "original, holds",
    [
        (lambda self, group_size=64, bits=4: None, True),
        (lambda self, bits=4, group_size=64: None, False),  # swapped
        (lambda self, group_size=32, bits=4: None, False),  # another default
        (lambda self, group_size=64, bits=4, mode="affine": None, False),  # more
        (lambda self, group_size=64, bits=4, *, mode="affine": None, False),
        (lambda self, group_size=64, bits=4, **options: None, False),
        (lambda self, group_size=64: None, False),  # fewer
    ],
)
def test_a_replacement_stands_for_a_target_taking_what_it_takes(original, holds):
    assert (contract.signature_problem(wrapper, original) is None) == holds


def test_a_replacement_taking_any_more_stands_for_a_target_with_more():
    def passing(self, tokenizer, *args, **kwargs):
        pass

    original = lambda self, tokenizer, request, *, stream=False, **extra: None  # noqa
    assert contract.signature_problem(passing, original) is None


def other(renamed):
    """A function taking what no replacement of the package takes."""


def test_every_replaced_target_is_checked_against_its_replacement(server, monkeypatch):
    mlx_lm_mla.install()
    replaced = [p for p in table_rows() if p.how in ("wrap", "rebind", "classmethod")]
    mlx_lm_mla.uninstall()
    unchecked = []
    for patch in replaced:
        path, _, name = patch.target.rpartition(".")
        owner = importlib.import_module(patch.module)
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        with monkeypatch.context() as m, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            instead = classmethod(other) if patch.how == "classmethod" else other
            m.setattr(owner, name, instead)
            mlx_lm_mla.install()
            if not any(gone.startswith(label(patch)) for gone in patches.missing()):
                unchecked.append(label(patch))
            mlx_lm_mla.uninstall()
    assert {p.how for p in replaced} == {"wrap", "rebind", "classmethod"}
    assert unchecked == []


# --- a name that does not hold, of each kind --------------------------------


def search(self, tokens, model):
    """PromptTrie.search with its parameters swapped."""


def test_a_method_with_other_parameters_switches_off_its_feature_alone(
    server, all_features, monkeypatch, caplog
):
    trie = importlib.import_module("mlx_lm.models.cache").PromptTrie
    monkeypatch.setattr(trie, "search", search)
    name = "mlx_lm.models.cache.PromptTrie.search"
    assert_only_off(REUSE, all_features, caplog, name)


def replace(monkeypatch, module, name, value):
    """Sets ``module.name`` for the test (``mlx_lm.generate`` by import: the
    package's attribute of that name is a function); returns its dotted name."""
    monkeypatch.setattr(importlib.import_module(module), name, value)
    return f"{module}.{name}"


def generate_step(prompt, model, *, prompt_cache=None, kv_group_size=64):
    """generate_step without a kv_bits keyword."""


def test_a_keyword_taken_no_more_switches_off_its_feature_alone(
    server, all_features, monkeypatch, caplog
):
    name = replace(monkeypatch, "mlx_lm.generate", "generate_step", generate_step)
    assert_only_off(CACHE_CHECKS, all_features, caplog, name)


class BatchGenerator:
    """mlx-lm's BatchGenerator, its prefilled rows under another name."""

    def __init__(self, model):
        self.model = model
        self._prefill_batch = self._generation_batch = None

    def _next(self):
        pass

    def insert_segments(self, segments, max_tokens=None, caches=None):
        pass


def test_a_renamed_field_switches_off_its_feature_alone(
    server, all_features, monkeypatch, caplog
):
    replace(monkeypatch, "mlx_lm.generate", "BatchGenerator", BatchGenerator)
    name = "mlx_lm.generate.BatchGenerator._prompt_batch"
    assert_only_off(KV_BATCHING, all_features, caplog, name)


def test_a_property_that_is_no_more_switches_off_its_feature_alone(
    server, all_features, monkeypatch, caplog
):
    monkeypatch.setattr(server.ResponseGenerator, "cli_args", None)
    name = "mlx_lm.server.ResponseGenerator.cli_args"
    assert_only_off(KV_BATCHING, all_features, caplog, name)


def test_a_class_looked_up_by_name_that_is_gone_switches_off_its_feature_alone(
    server, all_features, monkeypatch, caplog
):
    monkeypatch.delattr(server, "GenerationContext")
    assert_only_off(RECOVERY, all_features, caplog, "mlx_lm.server.GenerationContext")


def test_a_parser_made_otherwise_switches_off_the_features_that_change_it(
    server, all_features, monkeypatch, caplog
):
    monkeypatch.setattr(server, "argparse", types.ModuleType("argparse"))
    off, line = install_logged(caplog)
    assert "mlx_lm.server.argparse" in patches.missing()
    # The disk tier's flags, and the --kv-bits batching its help tells of.
    assert sorted(off) == sorted([DISK, KV_BATCHING])
    assert features_on() == all_features - {DISK, KV_BATCHING}


def provider_init(self, cli_args):
    """ModelProvider.__init__ keying the command line's model otherwise."""
    self.cli_args = cli_args


def test_a_dict_key_no_more_in_the_source_switches_off_its_feature_alone(
    server, all_features, monkeypatch, caplog
):
    monkeypatch.setattr(server.ModelProvider, "__init__", provider_init)
    name = 'mlx_lm.server.ModelProvider.__init__ "default_model"'
    assert_only_off(DISK, all_features, caplog, name)


def main():
    """mlx_lm.server.main with its flags, --kv-bits gone."""
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--adapter-path", "--draft-model", "--kv-group-size"):
        parser.add_argument(flag)
    parser.add_argument("--quantized-kv-start")
    parser.parse_args()


def test_a_flag_no_more_defined_switches_off_the_features_that_read_it(
    server, all_features, monkeypatch, caplog
):
    monkeypatch.setattr(mlx_lm, "__version__", "0.32.2")  # one that has --kv-bits
    monkeypatch.setattr(server, "main", main)
    available = lambda self: True  # noqa: E731 (mlx-lm 0.32 has it)
    monkeypatch.setattr(
        server.ResponseGenerator, "generation_available", available, raising=False
    )
    cache = importlib.import_module("mlx_lm.models.cache")
    for c in cache.KVCache.__mro__:  # nor meta_state
        if "meta_state" in vars(c):
            monkeypatch.delattr(c, "meta_state")
    off, line = install_logged(caplog)
    assert patches.missing() == ['mlx_lm.server.main "--kv-bits"']
    assert set(off) == {KV_BATCHING, DISK}
    assert features_on() == all_features - {KV_BATCHING, DISK}


def test_a_replaced_target_with_other_parameters_switches_off_its_feature_alone(
    server, all_features, monkeypatch, caplog
):
    swapped = lambda self, request, tokenizer, args: None  # noqa: E731
    monkeypatch.setattr(server.ResponseGenerator, "_tokenize", swapped)
    name = "mlx_lm.server.ResponseGenerator._tokenize"
    assert_only_off(REQUEST_CHECKS, all_features, caplog, name)
    assert name not in mlx_lm_mla.installed()


def test_a_target_there_with_other_parameters_is_named_with_what_it_takes(
    server, monkeypatch
):
    swapped = lambda self, request, tokenizer, args: None  # noqa: E731
    monkeypatch.setattr(server.ResponseGenerator, "_tokenize", swapped)
    with pytest.warns(RuntimeWarning) as warned:
        mlx_lm_mla.install()
    message = " ".join(str(w.message) for w in warned)
    assert (
        "mlx_lm.server.ResponseGenerator._tokenize (takes (self, request, " in message
    )


def test_an_mlx_name_of_another_form_switches_off_the_features_that_read_it(
    server, all_features, monkeypatch, caplog
):
    import mlx.core as mx

    monkeypatch.setattr(mx.random, "state", None)
    off, line = install_logged(caplog)
    assert patches.missing() == ["mlx.core.random.state"]
    read = set(contract.BY_LABEL["mlx.core.random.state"].features)
    assert set(off) == read and features_on() == all_features - read


def test_a_stock_cache_class_that_is_gone_switches_off_everything(
    server, monkeypatch, caplog
):
    cache = importlib.import_module("mlx_lm.models.cache")
    monkeypatch.delattr(cache, "RotatingKVCache")
    off, line = install_logged(caplog)
    assert patches.missing() == ["mlx_lm.models.cache.RotatingKVCache"]
    assert off == [EVERYTHING] and mlx_lm_mla.installed() == []


def test_a_tiny_model_needs_the_names_it_reads_and_names_what_is_gone(monkeypatch):
    import mlx_lm.utils

    from mlx_lm_mla import tiny

    monkeypatch.setattr(mlx_lm.utils, "_get_classes", lambda model_config: None)
    with pytest.raises(
        RuntimeError, match=r"mlx_lm\.utils\._get_classes: takes \(model_config\)"
    ):
        tiny.build_model("glm4_moe_lite")


# --- the reads with a fallback: a model's, its attention's, tuples, switches ---


def assert_off(features, all_features, caplog, name):
    install_logged(caplog)
    assert patches.missing() == [name]
    off = {f for f in all_features if f not in features_on()}
    assert off == set(features) & all_features


def test_a_model_whose_layers_are_renamed_switches_off_what_reads_them(
    server, all_features, monkeypatch, caplog
):
    glm = importlib.import_module("mlx_lm.models.glm4_moe_lite")
    monkeypatch.delattr(glm.Model, "layers")
    name = "mlx_lm.models.glm4_moe_lite.Model.layers"
    assert_off((QUANTIZE, CACHE_CHECKS, KV_BATCHING), all_features, caplog, name)
    assert KV_BATCHING not in features_on()


@dataclasses.dataclass
class ModelArgs:
    """deepseek_v3's ModelArgs, its context under another name."""

    model_type: str = "deepseek_v3"
    vocab_size: int = 1
    context_length: int = 1


def test_model_arguments_renamed_switch_off_the_request_checks_alone(
    server, all_features, monkeypatch, caplog
):
    deepseek = importlib.import_module("mlx_lm.models.deepseek_v3")
    monkeypatch.setattr(deepseek, "ModelArgs", ModelArgs)
    name = "mlx_lm.models.deepseek_v3.ModelArgs.max_position_embeddings"
    assert_only_off(REQUEST_CHECKS, all_features, caplog, name)


def _generate(self):
    """ResponseGenerator._generate reading _tokenize's tuple in another order."""
    rqueue, request, args = self._next_request()
    segments, prompt, segment_types, state, _ = self._tokenize(None, request, args)


def test_a_tuple_read_by_position_in_another_order_switches_off_its_feature_alone(
    server, all_features, monkeypatch, caplog
):
    monkeypatch.setattr(server.ResponseGenerator, "_generate", _generate)
    name = "mlx_lm.server.ResponseGenerator._tokenize()"
    try:
        assert_only_off(REQUEST_CHECKS, all_features, caplog, name)
    finally:  # its wrappers go before monkeypatch puts the original back
        mlx_lm_mla.uninstall()


def test_a_version_switch_that_no_longer_tells_releases_apart_switches_off(
    server, all_features, monkeypatch, caplog
):
    cache = importlib.import_module("mlx_lm.models.cache")
    if hasattr(cache.KVCache, "meta_state"):  # before 0.32: gone, as after
        owner = next(c for c in cache.KVCache.__mro__ if "meta_state" in vars(c))
        monkeypatch.delattr(owner, "meta_state")
    else:  # from 0.32 on: back, as before
        monkeypatch.setattr(cache.KVCache, "meta_state", property(tuple), raising=False)
    name = "mlx_lm.models.cache.KVCache.meta_state"
    assert_only_off(QUANTIZE, all_features, caplog, name)


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """What an MLA attention calls (mla.calls reads the call by its name)."""


class Glm4MoeLiteAttention:
    """glm4_moe_lite's MLA attention, its RoPE width under another name."""

    def __init__(self):
        self.kv_lora_rank, self.embed_q, self.rope_width = 1, None, 1

    def __call__(self, x, mask=None, cache=None):
        return scaled_dot_product_attention(x, x, x, cache, 1.0, mask)


def test_an_attention_width_renamed_switches_off_the_cache_checks_alone(
    server, all_features, monkeypatch, caplog
):
    glm = importlib.import_module("mlx_lm.models.glm4_moe_lite")
    monkeypatch.setattr(glm, "Glm4MoeLiteAttention", Glm4MoeLiteAttention)
    name = "mlx_lm.models.glm4_moe_lite.Glm4MoeLiteAttention.qk_rope_head_dim"
    off, line = install_logged(caplog)
    assert patches.missing() == [name] and off == [CACHE_CHECKS]
    # The class's own features are named for the module that defines it.
    own = {f for f in all_features if "glm4_moe_lite" in f}
    assert features_on() >= all_features - own - {CACHE_CHECKS}
    assert CACHE_CHECKS not in features_on()
