"""Read-ahead and the cold-start measurements: the reads happen (and land in the page cache), the
thread ends, failures become one warning, nothing is printed, and the spans are exactly what
the loader reads."""

from __future__ import annotations

import os
import threading
import warnings

import pytest

from flux_klein_mlx.bench import measure
from flux_klein_mlx.bench.measure import StageMeter, drop_from_page_cache, storage_read_bytes
from flux_klein_mlx.storage import readahead as ra
from flux_klein_mlx.storage.readahead import ReadAhead, Span, merge_spans


def data_file(folder, name="w.bin", size=(24 << 20) + 123):
    path = folder / name
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    return path


def test_read_ahead_reads_every_byte_and_its_thread_ends(tmp_path, capfd):
    files = [data_file(tmp_path, "a.bin"), data_file(tmp_path, "b.bin", 1000)]
    ahead = ReadAhead.of_files(files, chunk_bytes=1 << 20).start()
    stats = ahead.wait(timeout=60)
    assert ahead.done and not any(t.name.startswith("flux_klein_mlx-") for t in threading.enumerate())
    assert stats.bytes == sum(f.stat().st_size for f in files) and stats.spans == 2 and stats.error is None
    assert stats.rate > 0
    with ReadAhead.of_files(files) as ahead:  # the context manager stops and joins
        pass
    assert ahead.done
    assert capfd.readouterr() == ("", "")


@pytest.mark.skipif(storage_read_bytes() is None or not hasattr(os, "posix_fadvise"), reason="Linux I/O accounting")
def test_read_ahead_fills_the_page_cache_and_drop_empties_it(tmp_path):
    f = data_file(tmp_path)
    size = f.stat().st_size
    assert "posix_fadvise" in drop_from_page_cache([f])
    before = storage_read_bytes()
    ReadAhead.of_files([f]).start().wait(timeout=60)
    cold = storage_read_bytes() - before
    if cold == 0:
        pytest.skip("this file system does not count reads from storage (tmpfs?)")
    assert cold >= 0.9 * size  # the read-ahead fetched the file from the disk...
    before = storage_read_bytes()
    assert measure.sequential_read_rate([Span(f, 0, size)]).bytes == size
    assert storage_read_bytes() - before < 0.05 * size  # ...so a following read finds it cached
    drop_from_page_cache([f])
    before = storage_read_bytes()
    measure.sequential_read_rate([Span(f, 0, size)])
    assert storage_read_bytes() - before >= 0.9 * size  # dropped: read from the disk again


def test_stop_ends_the_thread_early(tmp_path):
    ahead = ReadAhead([Span(ra.Path(os.devnull), 0, 1 << 40)], chunk_bytes=1 << 16)
    ahead._stop.set()  # stopped before it starts: nothing may be read
    stats = ahead.start().wait(timeout=10)
    assert ahead.done and stats.stopped and stats.bytes == 0
    f = data_file(tmp_path, size=(4 << 20) + 5)
    whole = ra.read_spans([Span(f, 0, f.stat().st_size)], chunk_bytes=1 << 20, readers=3)  # 5 chunks, 3 readers
    assert whole.bytes == f.stat().st_size and not whole.stopped and whole.error is None


def test_a_failed_read_is_one_warning_never_an_exception(tmp_path, capfd):
    missing = ReadAhead.of_files([tmp_path / "missing.safetensors"]).start()  # stat fails on the thread
    short = ReadAhead([Span(data_file(tmp_path, size=100), 0, 4096)]).start()  # the file ends early
    damaged = tmp_path / "bad.safetensors"
    damaged.write_bytes(b"\xff" * 64)
    header = ReadAhead(lambda: ra.tensor_spans([damaged])).start()
    for ahead in (missing, short, header):
        with pytest.warns(UserWarning, match="reading ahead stopped early") as record:
            stats = ahead.wait(timeout=10)
        assert len(record) == 1 and stats.error and ahead.done
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ahead.stop()  # said once
    assert capfd.readouterr() == ("", "")


def test_spans_merge_in_file_order():
    a, b = ra.Path("a"), ra.Path("b")
    spans = [Span(b, 0, 10), Span(a, 100, 200), Span(a, 0, 50), Span(a, 300 + (2 << 20), 400 + (2 << 20))]
    assert merge_spans(spans, gap=100) == [Span(a, 0, 200), Span(a, 300 + (2 << 20), 400 + (2 << 20)), Span(b, 0, 10)]


def test_component_spans_are_exactly_what_the_loader_reads(tmp_path_factory):
    from tiny_model import shared_tiny_snapshot

    from flux_klein_mlx.run.components import read_component
    from flux_klein_mlx.run.loading import describe

    info = describe(shared_tiny_snapshot(tmp_path_factory))
    for name in ("transformer", "text_encoder", "vae"):
        loaded = sum(v.nbytes for v in read_component(info, name).values())  # lazy: headers only
        assert measure.bytes_to_load(info, name) == loaded, name
    files = sum(f.stat().st_size for f in info.files["text_encoder"])
    assert measure.bytes_to_load(info, "text_encoder") < files  # layer 28 of 28 is never read


def test_stage_meter_counts_time_and_bytes(tmp_path):
    meter = StageMeter()
    measure.sequential_read_rate([Span(data_file(tmp_path, size=1 << 20), 0, 1 << 20)])
    stage = meter.mark("read")
    assert stage["seconds"] > 0 and set(meter.stages) == {"read"}
    assert (stage["read_bytes"] is None) == (storage_read_bytes() is None)
    assert measure.limit_seconds(2e9, 1e9, 3e12, 1e12) == pytest.approx(5.0)


def test_cold_start_script_runs_on_the_tiny_snapshot(tmp_path_factory):
    """benchmarks/cold_start.py's measurements, in-process on the tiny snapshot (so they cannot rot)."""
    import importlib.util

    from tiny_model import shared_tiny_snapshot

    path = ra.Path(__file__).resolve().parents[1] / "benchmarks" / "cold_start.py"
    spec = importlib.util.spec_from_file_location("benchmarks_cold_start", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = str(shared_tiny_snapshot(tmp_path_factory))
    loads = [
        dict(script.child_load(model, "vae", readahead=mode, overlap=0.05), cold=False) for mode in (None, "overlap")
    ]
    # The load holds what it read, with or without read-ahead (in-process, the peak also counts
    # whatever earlier tests still hold; the script runs each load in a fresh process).
    assert all(x["peak_memory"] >= x["bytes_to_load"] for x in loads)
    assert abs(loads[0]["peak_memory"] - loads[1]["peak_memory"]) < 1 << 20
    assert loads[1]["readahead"]["bytes"] <= loads[1]["bytes_to_load"]
    cache = script.child_cache(model)
    assert cache["hit_equals"] and cache["entry_bytes"] > 512 * 7680 * 2
    results = {
        "model": model,
        "drop": "not dropped",
        "sequential": {"bytes": 1e9, "seconds": 1.0, "rate": 1e9},
        "loads": loads,
        "cache": cache,
        "limit": {"bytes": 1e9, "read_seconds": 1.0, "flops_1024_4_steps": 1e12, "compute_seconds_at_peak": None},
    }
    text = script.report(results)
    assert "| vae | warm | overlap:" in text and "hit bit-identical: True" in text
