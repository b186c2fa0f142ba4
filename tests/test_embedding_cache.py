"""The prompt-embedding disk cache: exact hits, keys that change with what decides the numbers,
damaged entries, unwritable folders, the size bound and concurrent writers.

Hits are checked against the real text encoder of the tiny snapshot (tests/support/tiny_model.py);
key tests use small safetensors files of their own, edited in place.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from flux_klein_mlx.errors import FluxKleinError
from flux_klein_mlx.storage import embedding_cache as ec
from flux_klein_mlx.storage import files
from flux_klein_mlx.storage.embedding_cache import (
    CacheWarning,
    EmbeddingCache,
    cached_embeddings,
    default_folder,
    parse_size,
)

# The model-side imports (torch, transformers, mlx-lm) are made where they are used, so that the
# writer processes of the concurrency test, which import this module, start in a fraction of a second.

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
KEY_ARGS = dict(template=TEMPLATE, max_length=512, prompt="a red fox", settings={"dtype": "bfloat16"})


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    from tiny_model import shared_tiny_snapshot

    return shared_tiny_snapshot(tmp_path_factory)


@pytest.fixture(scope="module")
def encoder(snapshot):
    """{dtype name: (text encoder, tokenizer)} for the tiny snapshot."""
    from flux_klein_mlx.models.tokenizer import load_tokenizer
    from flux_klein_mlx.run.components import load_component
    from flux_klein_mlx.run.loading import describe

    tok, info = load_tokenizer(snapshot), describe(snapshot)
    return {
        n: (load_component(info, "text_encoder", d), tok)
        for n, d in (("bfloat16", mx.bfloat16), ("float32", mx.float32))
    }


def weight_file(folder: Path, name: str = "model.safetensors", value: float = 1.0) -> Path:
    path = folder / name
    mx.save_safetensors(str(path), {"w": mx.full((4, 8), value)}, metadata={"tag": "aaaa"})
    return path


def entry_array(seed: int = 0, dtype=mx.bfloat16, width: int = 96) -> mx.array:
    return mx.random.normal((1, 512, width), key=mx.random.key(seed)).astype(dtype)


# ---- hits equal misses, bit for bit -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_hit_is_bit_identical_to_the_encoders_output(snapshot, encoder, tmp_path, dtype):
    from flux_klein_mlx.models.text_encoder import encode_prompts
    from flux_klein_mlx.models.tokenizer import FLUX2_WINDOW
    from flux_klein_mlx.run.loading import describe

    model, tok = encoder[dtype]
    files = describe(snapshot).files["text_encoder"]
    # bf16 matmuls are slow on the CPU backend: one prompt there, a batch of two in float32.
    prompts = ["a red fox in fresh snow"] if dtype == "bfloat16" else ["a red fox in fresh snow", ""]
    miss = encode_prompts(model, tok, prompts, FLUX2_WINDOW)  # (2, 512, 96)
    mx.eval(miss)
    cache = EmbeddingCache(tmp_path / "c")
    template = tok.hf_tokenizer.chat_template
    keys = {
        p: cache.key(files, template=template, max_length=512, prompt=p, settings={"dtype": dtype}) for p in prompts
    }
    calls = []

    def encode(missing):
        calls.append(list(missing))
        emb = encode_prompts(model, tok, missing, FLUX2_WINDOW)
        return [emb[i : i + 1] for i in range(len(missing))]  # one (1, 512, 96) per prompt

    first = cached_embeddings(cache, keys, encode)
    assert calls == [prompts]
    # A fresh cache object on the same folder (a new process): no encoder call, same bits.
    again = EmbeddingCache(tmp_path / "c")
    keys2 = {
        p: again.key(files, template=template, max_length=512, prompt=p, settings={"dtype": dtype}) for p in prompts
    }
    assert keys2 == keys
    second = cached_embeddings(again, keys2, encode)
    assert calls == [prompts]  # nothing encoded the second time
    for i, p in enumerate(prompts):
        for got in (first[p], second[p]):
            assert got.dtype == miss.dtype and got.shape == (1, 512, 96)
            bits = mx.uint16 if dtype == "bfloat16" else mx.uint32  # the bits, not just the values (-0.0, NaNs)
            assert (np.asarray(got.view(bits)) == np.asarray(miss[i : i + 1].view(bits))).all()


def test_a_cached_run_opens_no_weight_file(snapshot, tmp_path, monkeypatch):
    from flux_klein_mlx.run.loading import describe

    files = describe(snapshot).files["text_encoder"]
    key = EmbeddingCache(tmp_path).key(files, **KEY_ARGS)

    def no_reading(path):
        raise AssertionError(f"opened {path}")

    monkeypatch.setattr(ec, "safetensors_header_bytes", no_reading)
    assert EmbeddingCache(tmp_path).key(files, **KEY_ARGS) == key  # header digests remembered on disk


def test_template_is_read_without_building_the_tokenizer(snapshot, encoder, tmp_path):
    import shutil

    from flux_klein_mlx.models.tokenizer import chat_template_source

    _, tok = encoder["float32"]
    assert chat_template_source(snapshot) == tok.hf_tokenizer.chat_template
    folder = tmp_path / "tokenizer"
    shutil.copytree(snapshot / "tokenizer", folder)
    (folder / "chat_template.jinja").write_text("{{ messages }}")  # transformers prefers this file
    assert chat_template_source(folder) == "{{ messages }}"
    (folder / "chat_template.jinja").unlink()
    config = (folder / "tokenizer_config.json").read_text()
    (folder / "tokenizer_config.json").write_text(config.replace('"chat_template"', '"no_template"'))
    with pytest.raises(FluxKleinError, match="no chat template"):
        chat_template_source(folder)


def test_cached_embeddings_without_a_cache_encodes_everything():
    out = cached_embeddings(None, {"a": "", "b": ""}, lambda ps: [mx.full((1, 512, 3), float(len(p))) for p in ps])
    assert set(out) == {"a", "b"} and out["a"].shape == (1, 512, 3)


# ---- the key changes with what decides the numbers ----------------------------------------------


def _touch_ns(path: Path, mtime_ns: int) -> None:
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_key_changes_with_the_weights_size(tmp_path):
    f = weight_file(tmp_path)
    cache = EmbeddingCache(tmp_path / "c")
    before, mtime = cache.key([f], **KEY_ARGS), f.stat().st_mtime_ns
    with open(f, "ab") as out:
        out.write(b"\0" * 8)  # same header, same mtime below: only the size differs
    _touch_ns(f, mtime)
    assert cache.key([f], **KEY_ARGS) != before


def test_key_changes_with_the_weights_mtime(tmp_path):
    f = weight_file(tmp_path)
    cache = EmbeddingCache(tmp_path / "c")
    before = cache.key([f], **KEY_ARGS)
    _touch_ns(f, f.stat().st_mtime_ns - 10**9)
    assert cache.key([f], **KEY_ARGS) != before


def test_key_changes_with_the_weights_header(tmp_path):
    """Same size and mtime, another header (a re-saved file with its mtime preserved, as `cp -p` does)."""
    f = weight_file(tmp_path)
    cache = EmbeddingCache(tmp_path / "c")
    before, st = cache.key([f], **KEY_ARGS), f.stat()
    blob = f.read_bytes()
    assert blob.count(b'"aaaa"') == 1
    f.write_bytes(blob.replace(b'"aaaa"', b'"bbbb"'))
    _touch_ns(f, st.st_mtime_ns)
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert cache.key([f], **KEY_ARGS) != before
    assert EmbeddingCache(tmp_path / "c").key([f], **KEY_ARGS) != before  # also for a new process


def test_key_changes_with_the_template(tmp_path):
    f, cache = weight_file(tmp_path), EmbeddingCache(tmp_path / "c")
    assert cache.key([f], **{**KEY_ARGS, "template": TEMPLATE + " "}) != cache.key([f], **KEY_ARGS)


def test_key_changes_with_the_max_length(tmp_path):
    f, cache = weight_file(tmp_path), EmbeddingCache(tmp_path / "c")
    assert cache.key([f], **{**KEY_ARGS, "max_length": 256}) != cache.key([f], **KEY_ARGS)


def test_key_changes_with_the_prompt(tmp_path):
    f, cache = weight_file(tmp_path), EmbeddingCache(tmp_path / "c")
    assert cache.key([f], **{**KEY_ARGS, "prompt": "a red fox "}) != cache.key([f], **KEY_ARGS)
    assert cache.key([f], **{**KEY_ARGS, "settings": {"dtype": "float32"}}) != cache.key([f], **KEY_ARGS)


def test_key_is_stable_and_follows_the_resolved_file(tmp_path):
    f = weight_file(tmp_path)
    link = tmp_path / "link.safetensors"
    link.symlink_to(f)
    cache = EmbeddingCache(tmp_path / "c")
    assert (
        cache.key([f], **KEY_ARGS)
        == cache.key([link], **KEY_ARGS)
        == EmbeddingCache(tmp_path / "c").key([f], **KEY_ARGS)
    )


# ---- damaged entries ----------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty", "other_key"])
def test_damaged_entry_is_ignored_and_rewritten(tmp_path, damage):
    cache = EmbeddingCache(tmp_path)
    key, other = "a" * 64, "b" * 64
    x = entry_array()
    assert cache.put(key, x)
    path = cache.path_of(key)
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) - 100])
    elif damage == "flip":
        path.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    elif damage == "garbage":
        path.write_bytes(b"\xff" * 64)
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a valid entry stored under another key's name
        assert cache.put(other, x)
        os.replace(cache.path_of(other), path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get(key) is None
    assert not path.exists()  # removed, so it cannot be served later either
    assert cache.put(key, x)
    assert mx.array_equal(cache.get(key), x).item()


# ---- folders that cannot be written -------------------------------------------------------------


def _one_cache_warning(record) -> str:
    found = [w for w in record if issubclass(w.category, CacheWarning)]
    assert len(found) == 1, [str(w.message) for w in record]
    return str(found[0].message)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_degrades_with_one_warning(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    cache = EmbeddingCache(folder)
    assert cache.put("a" * 64, entry_array())
    folder.chmod(0o500)
    try:
        cache = EmbeddingCache(folder)
        with pytest.warns(CacheWarning) as record:
            assert not cache.put("b" * 64, entry_array(1))
            assert not cache.put("c" * 64, entry_array(2))
            cache.key([weight_file(tmp_path)], **KEY_ARGS)
        assert "cannot write" in _one_cache_warning(record)
        assert cache.get("a" * 64) is not None  # what is there is still served
    finally:
        folder.chmod(0o700)


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_unwritable_folder_degrades_with_one_warning(tmp_path, monkeypatch, err):
    """Read-only file system, no permission, or a full disk (the kernel's own ENOSPC from /dev/full)."""
    cache = EmbeddingCache(tmp_path / "c")
    assert cache.put("a" * 64, entry_array())
    dev_full = Path("/dev/full")

    def failing_temporary(path):
        if err == errno.ENOSPC and dev_full.exists():
            tmp = path.with_name(".tmp-full")
            tmp.symlink_to(dev_full)  # writes through it fail with ENOSPC; the link must be cleaned up
            return tmp
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(files, "temporary_name", failing_temporary)
    with pytest.warns(CacheWarning) as record:
        assert not cache.put("b" * 64, entry_array(1))
        assert not cache.put("c" * 64, entry_array(2))
        cache.key([weight_file(tmp_path)], **KEY_ARGS)  # no second warning from the header memo either
    message = _one_cache_warning(record)
    assert str(tmp_path / "c") in message and "\n" not in message
    if err == errno.ENOSPC:
        assert "disk is full" in message
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == [f"{'a' * 64}.safetensors"]  # no temporary file left behind
    assert cache.get("a" * 64) is not None


def test_zero_size_stores_nothing_and_says_nothing(tmp_path):
    cache = EmbeddingCache(tmp_path / "c", max_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cache.put("a" * 64, entry_array())
        cache.key([weight_file(tmp_path)], **KEY_ARGS)
    assert not (tmp_path / "c").exists()


# ---- the bound ----------------------------------------------------------------------------------


def test_never_grows_past_its_limit_and_evicts_least_recently_used(tmp_path):
    size = sum(len(p) for p in ec.encode_entry(entry_array(), "0" * 64))
    cache = EmbeddingCache(tmp_path, max_bytes=3 * size + size // 2)  # room for 3 entries
    keys = [f"{i:064x}" for i in range(6)]
    clock = 1_000_000_000_000_000_000
    for i, key in enumerate(keys):
        assert cache.put(key, entry_array(i))
        os.utime(cache.path_of(key), ns=(clock + i * 10**9,) * 2)  # distinct, ordered use times
        assert cache.total_bytes() <= cache.max_bytes
        if i == 3:
            assert cache.get(keys[1]) is not None  # a hit makes keys[1] the most recently used
    left = {e.path.name[:64] for e in cache.entries()}
    assert left == {keys[1], keys[4], keys[5]}
    assert cache.total_bytes() <= cache.max_bytes
    assert not cache.put("f" * 64, mx.zeros((1, 512, 4096), dtype=mx.float32))  # bigger than the whole cache
    cache.clear()
    assert cache.entries() == []


# ---- two processes, one entry -------------------------------------------------------------------


def _write_many(folder: str, key: str, barrier, rounds: int) -> None:
    cache = EmbeddingCache(folder)
    x = entry_array(7)
    barrier.wait()
    for _ in range(rounds):
        assert cache.put(key, x)


def test_two_processes_writing_the_same_entry_leave_one_valid_entry(tmp_path):
    ctx = mp.get_context("spawn")  # no fork of a process that holds MLX's threads
    barrier = ctx.Barrier(2)
    key = "c" * 64
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), key, barrier, 40)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{key}.safetensors"]
    assert mx.array_equal(EmbeddingCache(tmp_path).get(key), entry_array(7)).item()


# ---- settings -----------------------------------------------------------------------------------


def test_default_folder_follows_the_environment(tmp_path):
    assert default_folder({"FLUX_KLEIN_CACHE": str(tmp_path / "x"), "XDG_CACHE_HOME": "/xdg"}) == tmp_path / "x"
    assert default_folder({"XDG_CACHE_HOME": "/xdg", "HOME": "/h"}) == Path("/xdg/flux_klein_mlx")
    assert default_folder({"XDG_CACHE_HOME": "relative", "HOME": "/h"}) == Path("/h/.cache/flux_klein_mlx")
    assert default_folder({"FLUX_KLEIN_CACHE": "", "HOME": "/h"}) == Path("/h/.cache/flux_klein_mlx")
    assert EmbeddingCache.open_default(env={"FLUX_KLEIN_CACHE": str(tmp_path)}).folder == tmp_path / "embeddings"


def test_sizes_parse_and_bad_sizes_say_what_to_write():
    assert parse_size("1GB") == 10**9 and parse_size("500M") == 500 * 10**6 and parse_size("2GiB") == 2 << 30
    assert parse_size("0") == 0 and parse_size(1234) == 1234 and parse_size(" 1.5 kb ") == 1500
    for bad in ["", "-1GB", "1 TBX", "lots", "1e9", -5, True]:
        with pytest.raises(FluxKleinError, match="cache size must be"):
            parse_size(bad)
    for bad in [-1, 1.5, "1GB", None, True]:
        with pytest.raises(FluxKleinError, match="cache size must be"):
            EmbeddingCache("x", max_bytes=bad)
    with pytest.raises(ValueError, match="not a cache key"):
        EmbeddingCache("x").path_of("../../etc/passwd")


def test_cache_size_in_terabytes_and_a_bound_under_one_entry_are_said(distilled, cli, tmp_path):
    """Issue 38, case 16: `--cache-size 1TB` is a size (the refusal of an unknown unit lists the units), and
    `--cache-size 1` (one byte: no prompt fits) says once that nothing is stored, instead of nothing."""
    assert parse_size("1TB") == 10**12 and parse_size("2TiB") == 2 << 40 and parse_size("3t") == 3 * 10**12
    with pytest.raises(FluxKleinError, match="the units are B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"):
        parse_size("1PB")
    cache = ec.EmbeddingCache(tmp_path / "c", max_bytes=1)
    emb = mx.ones((1, 4, 8), dtype=mx.bfloat16)
    with pytest.warns(CacheWarning, match=r"--cache-size 1 bytes, is smaller than one prompt's embeddings \(\d+ bytes"):
        assert not cache.put("a" * 64, emb)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cache.put("b" * 64, emb)  # said once
    assert cache.entries() == []
    out = tmp_path / "x.png"
    base = ["generate", "-m", str(distilled), "-p", "a fox", "-W", "64", "-H", "64", "--steps", "1", "-o"]
    code, _, err = cli(*base, str(out), "--cache-size", "1")
    assert code == 0 and out.is_file(), err
    said = [line for line in err.splitlines() if "prompt cache" in line]
    assert len(said) == 1 and said[0].startswith("warning: the prompt cache stores nothing: its bound"), err
    code, _, err = cli(*base, str(tmp_path / "y.png"), "--cache-size", "1TB")
    assert code == 0 and "cache size" not in err, err
