"""save_prompt_cache / load_prompt_cache with MLA caches, exact and quantized.

load_prompt_cache is looked up on the module at call time, since install()
patches it there.
"""

import io
import os
import random
import zlib

import mlx.core as mx
import pytest
import mlx_lm.models.cache as cache_module
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

import mlx_lm_mla
from mlx_lm_mla import mla, tiny
from mlx_lm_mla.mla import is_latent
from mlx_lm_mla.checksum import CHECKSUM, CorruptCacheFile

from conftest import latent_kv, swap_layers_in_header

PROMPT = [(5 * i + 7) % 190 + 5 for i in range(20)]


def prefilled(model, bits=None):
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:14]]), cache=cache)
    if bits:
        for c in cache:
            if is_latent(c):
                c.to_quantized(group_size=32, bits=bits)
    return cache


def continue_from(model, cache):
    return model(mx.array([PROMPT[14:]]), cache=cache)


@pytest.mark.parametrize(
    "model_type", ["glm4_moe_lite", "deepseek_v32", "longcat_flash", "kimi_linear"]
)
@pytest.mark.parametrize("bits", [None, 4])
def test_round_trip_continues_exactly(model_type, bits, installed, tmp_path):
    model, _ = tiny.build_model(model_type)
    cache = prefilled(model, bits)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache, metadata={"model": model_type, "chat": "hi"})
    loaded, metadata = cache_module.load_prompt_cache(path, return_metadata=True)
    assert metadata == {"model": model_type, "chat": "hi"}
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    assert mx.array_equal(continue_from(model, loaded), continue_from(model, cache))


def test_quantization_settings_survive_the_file(installed, tmp_path):
    model, _ = tiny.build_model("glm4_moe_lite")
    cache = prefilled(model, bits=4)
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, cache)
    loaded = cache_module.load_prompt_cache(path)
    assert all((c.group_size, c.latent_bits, c.offset) == (32, 4, 14) for c in loaded)


@pytest.mark.parametrize("bits,group_size", [(8, 32), (4, 64)])
def test_a_loaded_latent_quantized_otherwise_than_kv_bits_is_refused_before_the_first_step(
    bits, group_size, installed, tmp_path
):
    from mlx_lm.generate import generate_step

    model, _ = tiny.build_model("glm4_moe_lite")
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, prefilled(model, bits=4))  # group size 32
    loaded = cache_module.load_prompt_cache(path)
    with pytest.raises(
        ValueError,
        match=f"group_size 32 and 4 bits; kv_bits {bits} with kv_group_size {group_size}",
    ):
        next(
            generate_step(
                mx.array(PROMPT[14:]),
                model,
                prompt_cache=loaded,
                max_tokens=2,
                kv_bits=bits,
                kv_group_size=group_size,
                quantized_kv_start=5000,
            )
        )
    assert all(c.offset == 14 for c in loaded)  # nothing was written


def test_a_zero_size_array_saves_and_loads_back_as_it_was(installed, tmp_path):
    # What mlx-lm 0.31's DSA indexer keeps as its values; mlx cannot write one.
    cache = cache_module.KVCache()
    keys = mx.random.normal((1, 1, 6, 8))
    cache.update_and_fetch(keys, mx.zeros((1, 1, 6, 0)))
    path = str(tmp_path / "empty.safetensors")
    save_prompt_cache(path, [cache], metadata={"chat": "hi"})
    loaded, metadata = cache_module.load_prompt_cache(path, return_metadata=True)
    assert metadata == {"chat": "hi"}
    step = (mx.random.normal((1, 1, 1, 8)), mx.zeros((1, 1, 1, 0)))
    (k, v), (k_loaded, v_loaded) = (
        cache.update_and_fetch(*step),
        loaded[0].update_and_fetch(*step),
    )
    assert v_loaded.shape == v.shape == (1, 1, 7, 0) and mx.array_equal(k_loaded, k)


def test_a_zero_size_array_inside_a_cache_list_loads_back_in_its_place(
    installed, tmp_path
):
    keys = mx.random.normal((1, 1, 6, 8))
    latent, indexer = cache_module.KVCache(), cache_module.KVCache()
    latent.update_and_fetch(keys, keys[..., :4])
    indexer.update_and_fetch(keys, mx.zeros((1, 1, 6, 0)))
    path = str(tmp_path / "list.safetensors")
    save_prompt_cache(path, [cache_module.CacheList(latent, indexer)])
    loaded = cache_module.load_prompt_cache(path)[0]
    step = (mx.ones((1, 1, 1, 8)), mx.zeros((1, 1, 1, 0)))
    for original, restored in zip((latent, indexer), loaded.caches):
        v = step[1] if original is indexer else step[0][..., :4]
        assert all(
            mx.array_equal(a, b)
            for a, b in zip(
                original.update_and_fetch(step[0], v),
                restored.update_and_fetch(step[0], v),
            )
        )


def test_a_cache_trimmed_to_nothing_saves_and_loads_back_empty(installed, tmp_path):
    cache = cache_module.KVCache()
    cache.update_and_fetch(mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 4, 8)))
    cache.trim(4)
    path = str(tmp_path / "trimmed.safetensors")
    save_prompt_cache(path, [cache])
    loaded = cache_module.load_prompt_cache(path)[0]
    assert loaded.offset == 0
    k, v = loaded.update_and_fetch(mx.zeros((1, 1, 2, 8)), mx.zeros((1, 1, 2, 8)))
    assert k.shape == v.shape == (1, 1, 2, 8)


def test_a_file_whose_zero_size_record_does_not_fit_is_refused_by_name(
    installed, tmp_path
):
    from mlx_lm_mla.patches.files import EMPTY

    cache = cache_module.KVCache()
    cache.update_and_fetch(mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 4, 8)))
    path = str(tmp_path / "record.safetensors")
    save_prompt_cache(
        path, [cache], metadata={EMPTY: '{"5": [["1", [1, 1, 4, 0], "float32"]]}'}
    )
    with pytest.raises(
        CorruptCacheFile, match=f"record.safetensors: its {EMPTY} record does not fit"
    ):
        cache_module.load_prompt_cache(path)


def test_truncated_file_is_refused_by_name(installed, tmp_path):
    model, _ = tiny.build_model("glm4_moe_lite")
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), prefilled(model))
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(
        CorruptCacheFile, match=r"c\.safetensors is truncated or corrupt"
    ):
        cache_module.load_prompt_cache(str(path))


def test_file_that_is_not_a_cache_is_refused(installed, tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CorruptCacheFile, match="unreadable header"):
        cache_module.load_prompt_cache(str(path))


def load_error(path):
    with pytest.raises(RuntimeError) as e:
        cache_module.load_prompt_cache(str(path))
    return e.value


@pytest.mark.parametrize("content", [None, b"not a safetensors file"])
def test_a_file_stock_cannot_read_raises_what_stock_raises(content, stock, tmp_path):
    path = tmp_path / "c.safetensors"  # missing, or not safetensors
    if content is not None:
        path.write_bytes(content)
    stock_error = load_error(path)
    mlx_lm_mla.install()
    try:
        ours = load_error(path)
    finally:
        mlx_lm_mla.uninstall()
    if content is None:  # stock's own error: the package does not look first
        assert type(ours) is type(stock_error) and str(ours) == str(stock_error)
    else:
        assert isinstance(ours, CorruptCacheFile)


def test_tampered_state_gives_a_clear_error(installed, tmp_path):
    model, _ = tiny.build_model("glm4_moe_lite")
    cache = prefilled(model, bits=4)
    good, path = str(tmp_path / "good.safetensors"), str(tmp_path / "t.safetensors")
    save_prompt_cache(good, cache)
    arrays, meta = mx.load(good, return_metadata=True)
    arrays["0.1"] = arrays["0.1"][:, :, :5]  # rope key of layer 0 cut short
    meta = {k: v for k, v in meta.items() if CHECKSUM not in k}  # as stock saves it
    mx.save_safetensors(path, arrays, meta)
    with pytest.raises(
        ValueError,
        match=r"QuantizedLatentCache state: expected uint8 arrays \(B, 1, L, 32\) and \(B, 1, L, 80\), got",
    ):
        cache_module.load_prompt_cache(path)


def test_cache_of_another_model_is_refused_when_used(installed, tmp_path):
    small, _ = tiny.build_model("glm4_moe_lite")
    wide, _ = tiny.build_model("glm4_moe_lite", kv_lora_rank=128)
    path = str(tmp_path / "other.safetensors")
    save_prompt_cache(path, prefilled(small, bits=4))
    with pytest.raises(ValueError, match="latent of width 128 .* holds widths 64"):
        continue_from(wide, cache_module.load_prompt_cache(path))


@pytest.mark.parametrize("bits", [None, 4])
def test_a_flipped_byte_in_the_data_is_refused_by_name(bits, installed, tmp_path):
    model, _ = tiny.build_model("glm4_moe_lite")
    good = tmp_path / "good.safetensors"
    save_prompt_cache(str(good), prefilled(model, bits))
    raw = good.read_bytes()
    data_start = 8 + int.from_bytes(raw[:8], "little")
    rng = random.Random(0)
    for trial in range(20):
        damaged = bytearray(raw)
        damaged[rng.randrange(data_start, len(raw))] ^= 1 << rng.randrange(8)
        path = tmp_path / f"flip{trial}.safetensors"
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptCacheFile, match="checksum does not match"):
            cache_module.load_prompt_cache(str(path))


def test_a_cache_without_a_latent_is_saved_as_stock_saves_it(installed, tmp_path):
    model, _ = tiny.build_model("deepseek_v2")  # full per-head K/V
    path = str(tmp_path / "plain.safetensors")
    save_prompt_cache(path, prefilled(model), metadata={"model": "v2"})
    _, meta = mx.load(path, return_metadata=True)
    assert not any(CHECKSUM in k for k in meta)


def test_full_kv_cache_is_refused_by_name_for_an_mla_model(installed, tmp_path):
    from mlx_lm.generate import generate_step

    full, _ = tiny.build_model("deepseek_v2")
    mla, _ = tiny.build_model("glm4_moe_lite")
    path = str(tmp_path / "v2.safetensors")
    save_prompt_cache(path, prefilled(full), metadata={"model": "v2"})
    loaded = cache_module.load_prompt_cache(path)
    with pytest.raises(
        ValueError,
        match=r"layer 0 \(KVCache\) holds per-head keys and values \(\d+ heads",
    ):
        next(generate_step(mx.array(PROMPT[14:]), mla, prompt_cache=loaded))


def test_plain_file_marked_quantized_names_the_missing_format(installed, tmp_path):
    model, _ = tiny.build_model("glm4_moe_lite")
    good, path = (
        str(tmp_path / "good.safetensors"),
        str(tmp_path / "marked.safetensors"),
    )
    save_prompt_cache(good, prefilled(model))
    arrays, meta = mx.load(good, return_metadata=True)
    meta = {
        k: ("QuantizedLatentCache" if v == "KVCache" else v) for k, v in meta.items()
    }
    mx.save_safetensors(
        path, arrays, {k: v for k, v in meta.items() if CHECKSUM not in k}
    )
    with pytest.raises(
        ValueError, match="QuantizedLatentCache: no quantization format"
    ):
        cache_module.load_prompt_cache(path)


def unreleased_layout(cache):
    """The arrays and format text of a layout that was never released: keys
    [packed latent | scales | biases], values the RoPE key, no layout name."""
    r, fmt = cache._sizes()[2], ",".join(map(str, cache._format))
    keys, values, *rest = (
        cache.state[:-1] if not hasattr(cache, "meta_state") else cache.state
    )
    return (
        mx.concatenate([keys, values[..., r:]], axis=-1),
        values[..., :r],
        *rest,
    ), fmt


def test_a_cache_in_a_layout_never_released_is_refused_by_name(installed):
    from mlx_lm_mla import QuantizedLatentCache

    model, _ = tiny.build_model("glm4_moe_lite")
    c = prefilled(model, bits=4)[0]
    arrays, fmt = unreleased_layout(c)
    with pytest.raises(
        ValueError, match="QuantizedLatentCache: no quantization format"
    ):
        if hasattr(c, "meta_state"):  # mlx-lm 0.31: the format ends the meta_state
            QuantizedLatentCache.from_state(arrays, tuple(c.meta_state[:-1]) + (fmt,))
        else:
            QuantizedLatentCache.from_state(arrays + (fmt,))


def test_the_checksum_is_of_every_byte_of_the_file_whatever_pieces_it_is_written_in(
    tmp_path,
):
    from mlx_lm_mla.checksum import add_checksum, check_cache_file

    arrays = {"a": mx.arange(1000, dtype=mx.float32)}

    def save(file, cache, metadata):  # into the checksum's sink 7 bytes at a time
        if isinstance(file, str):
            return mx.save_safetensors(file, arrays, metadata)
        whole = io.BytesIO()
        mx.save_safetensors(whole, arrays, metadata)
        raw = whole.getvalue()
        for i in range(0, len(raw), 7):
            file.write(raw[i : i + 7])

    metadata = {"k": "v"}
    size = add_checksum(save, None, metadata)
    path = str(tmp_path / "a.safetensors")
    save(path, None, metadata)
    check_cache_file(path)
    raw = open(path, "rb").read()
    value = metadata[CHECKSUM]
    assert len(raw) == size and raw.count(f'"{value}"'.encode()) == 1
    blank = raw.replace(value.encode(), value[:-8].encode() + b"00000000")
    assert value == f"file-crc32:{zlib.crc32(blank):08x}"


def test_a_header_that_swaps_two_layers_is_refused_by_its_checksum(installed, tmp_path):
    model, _ = tiny.build_model("glm4_moe_lite")
    good = tmp_path / "good.safetensors"
    save_prompt_cache(str(good), prefilled(model, bits=4))
    path = tmp_path / "swapped.safetensors"
    path.write_bytes(swap_layers_in_header(good.read_bytes()))
    with pytest.raises(CorruptCacheFile, match="checksum does not match"):
        cache_module.load_prompt_cache(str(path))


def test_a_file_with_the_data_only_checksum_of_earlier_releases_loads_and_is_checked(
    installed, tmp_path
):
    model, _ = tiny.build_model("glm4_moe_lite")
    cache = prefilled(model, bits=4)
    good = tmp_path / "good.safetensors"
    save_prompt_cache(str(good), cache)
    arrays, meta = mx.load(str(good), return_metadata=True)
    [key] = [k for k in meta if CHECKSUM in k]
    old = str(tmp_path / "old.safetensors")
    mx.save_safetensors(old, arrays, {**meta, key: "crc32:00000000"})
    raw = open(old, "rb").read()
    data = raw[8 + int.from_bytes(raw[:8], "little") :]
    mx.save_safetensors(old, arrays, {**meta, key: f"crc32:{zlib.crc32(data):08x}"})
    loaded = cache_module.load_prompt_cache(old)
    assert mx.array_equal(
        continue_from(model, loaded), continue_from(model, prefilled(model, bits=4))
    )
    damaged = bytearray(open(old, "rb").read())
    damaged[-1] ^= 1
    open(old, "wb").write(bytes(damaged))
    with pytest.raises(CorruptCacheFile, match="checksum does not match"):
        cache_module.load_prompt_cache(old)


def test_a_batch_whose_rows_differ_in_precision_is_refused_by_name(installed, tmp_path):
    from mlx_lm.models.cache import KVCache

    exact, quantized = latent_kv(5, seed=1), latent_kv(9, seed=2).to_quantized(64, 8)
    batch = KVCache.merge([exact, quantized])
    path = tmp_path / "mixed.safetensors"
    with pytest.raises(ValueError, match="BatchMixedLatentCache .* cannot be saved"):
        save_prompt_cache(str(path), [batch])
    assert not path.exists()


def _refused_by_generate_step(model, cache, message):
    from mlx_lm.generate import generate_step

    with pytest.raises(ValueError, match=message):
        next(generate_step(mx.array(PROMPT[14:]), model, prompt_cache=cache))


def test_a_cache_stock_quantized_is_refused_by_name_for_an_mla_model(installed):
    model, _ = tiny.build_model("glm4_moe_lite", **tiny.DEMO_WIDTHS)
    cache = prefilled(model)
    mlx_lm_mla.uninstall()
    try:  # what stock's --kv-bits makes of an MLA model's cache
        cache = [c.to_quantized(group_size=64, bits=4) for c in cache]
    finally:
        mlx_lm_mla.install()
    _refused_by_generate_step(
        model, cache, r"layer 0 \(QuantizedKVCache\) holds keys and values quantized"
    )


def test_a_cache_of_another_number_of_layers_is_refused_by_name(installed):
    fewer, _ = tiny.build_model("glm4_moe_lite", num_hidden_layers=1)
    model, _ = tiny.build_model("glm4_moe_lite", num_hidden_layers=2)
    _refused_by_generate_step(
        model, prefilled(fewer), "prompt cache holds 1 layer caches; this model makes 2"
    )


@pytest.mark.parametrize(
    "source,target,message",
    [
        (
            "deepseek_v32",
            "deepseek_v3",
            "layer 0 is a CacheList; this model makes a cache",
        ),
        (
            "deepseek_v3",
            "deepseek_v32",
            "layer 0 is a cache; this model makes a CacheList",
        ),
    ],
)
def test_a_cache_of_another_structure_is_refused_by_name(
    source, target, message, installed
):
    made, _ = tiny.build_model(source)
    model, _ = tiny.build_model(target)
    _refused_by_generate_step(model, prefilled(made), message)


def _saved(model, path, **metadata):
    cache = prefilled(model)
    save_prompt_cache(str(path), cache, metadata=metadata or None)
    return cache


def test_a_checksum_carried_over_in_the_metadata_is_made_again(installed, tmp_path):
    # Metadata of a file loaded without the package still holds its checksum.
    model, _ = tiny.build_model("glm4_moe_lite")
    path = tmp_path / "c.safetensors"
    _saved(model, path, **{CHECKSUM: "file-crc32:0badc0de"})
    assert len(cache_module.load_prompt_cache(str(path))) == len(model.layers)


def test_a_save_that_fails_midway_leaves_the_file_that_was_there(
    installed, tmp_path, monkeypatch
):
    model, _ = tiny.build_model("glm4_moe_lite")
    path = tmp_path / "c.safetensors"
    _saved(model, path)
    good = path.read_bytes()

    real = mx.save_safetensors

    def disk_full(file_name, arrays, metadata=None):
        if not isinstance(file_name, str):  # the checksum's count
            return real(file_name, arrays, metadata)
        with open(file_name, "wb") as f:
            f.write(good[: len(good) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_prompt_cache(str(path), prefilled(model))
    assert path.read_bytes() == good and os.listdir(tmp_path) == [path.name]


def test_a_save_through_a_link_writes_its_target_and_keeps_its_mode(
    installed, tmp_path
):
    model, _ = tiny.build_model("glm4_moe_lite")
    target, link = tmp_path / "target.safetensors", tmp_path / "link.safetensors"
    _saved(model, target)
    target.chmod(0o640)
    link.symlink_to(target.name)
    _saved(model, link, note="again")
    assert link.is_symlink() and oct(target.stat().st_mode & 0o777) == "0o640"
    _, metadata = cache_module.load_prompt_cache(str(link), return_metadata=True)
    assert metadata == {"note": "again"}


def test_a_loaded_cache_holds_the_bytes_that_were_checked(installed, tmp_path):
    model, _ = tiny.build_model("glm4_moe_lite")
    path, other = tmp_path / "c.safetensors", tmp_path / "other.safetensors"
    cache = _saved(model, path)
    loaded = cache_module.load_prompt_cache(str(path))
    _saved(tiny.build_model("glm4_moe_lite", seed=1)[0], other)
    path.write_bytes(other.read_bytes())  # the file changes after the load
    assert all(mx.array_equal(a.state[0], b.state[0]) for a, b in zip(loaded, cache))


def test_a_file_object_loads_as_stock_loads_it(installed, tmp_path):
    model, _ = tiny.build_model("glm4_moe_lite")
    path = tmp_path / "c.safetensors"
    cache = _saved(model, path, note="kept")
    with open(path, "rb") as f:
        loaded, metadata = cache_module.load_prompt_cache(f, return_metadata=True)
    assert metadata == {"note": "kept"}
    assert all(mx.array_equal(a.state[0], b.state[0]) for a, b in zip(loaded, cache))


def test_a_keyword_stock_does_not_take_is_refused_as_stock_refuses_it(
    installed, tmp_path
):
    model, _ = tiny.build_model("glm4_moe_lite")
    with pytest.raises(TypeError, match="unexpected keyword argument 'meta'"):
        save_prompt_cache(str(tmp_path / "c.safetensors"), prefilled(model), meta={})
    assert list(tmp_path.iterdir()) == []


def test_the_checked_save_has_stocks_signature(installed):
    from mlx_lm_mla.patches.contract import signature_problem

    saved = cache_module.save_prompt_cache  # mlx-lm 0.31: metadata={}
    assert signature_problem(saved, saved.mlx_lm_mla_original) is None


def test_a_save_where_no_new_file_can_be_made_writes_in_place(
    installed, tmp_path, monkeypatch
):
    model, _ = tiny.build_model("glm4_moe_lite")
    path = tmp_path / "c.safetensors"
    _saved(model, path)
    real = os.open

    def no_new_file(name, flags, *args):
        if flags & os.O_EXCL:  # a folder this process may not write in
            raise PermissionError(13, "Permission denied", name)
        return real(name, flags, *args)

    monkeypatch.setattr(os, "open", no_new_file)
    _saved(model, path, note="in place")
    monkeypatch.undo()
    _, metadata = cache_module.load_prompt_cache(str(path), return_metadata=True)
    assert metadata == {"note": "in place"} and os.listdir(tmp_path) == [path.name]


def test_a_cache_list_without_the_member_the_latent_goes_to_is_refused(installed):
    model, _ = tiny.build_model("deepseek_v32")
    cache = [cache_module.CacheList() for _ in model.layers]
    _refused_by_generate_step(
        model, cache, "layer 0 is a CacheList of 0; this model writes its latent"
    )


def test_a_refused_cache_is_left_as_it_was(installed):
    full, _ = tiny.build_model("deepseek_v2")
    mla_model, _ = tiny.build_model("glm4_moe_lite")
    cache = prefilled(full)  # a cache of another model, handed over by mistake
    for c in cache:  # as one built by hand: nothing says what it holds
        vars(c).pop(mla.MARK, None)
    _refused_by_generate_step(mla_model, cache, "per-head keys and values")
    assert not any(is_latent(c) for c in cache)
