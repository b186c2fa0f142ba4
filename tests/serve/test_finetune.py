"""Training over the API (issue 47), driven by the official `openai` client against a real `serve` of the
tiny Base model: the files (a zip of images and captions, checked and unpacked safely under --train-dir).

Bad input is one line and a 4xx each: a zip holding a non-image, a zip-slip name, a link, a caption that is
not text, a file that is not a zip; the zip checks themselves are also driven by Hypothesis in-process.
"""

from __future__ import annotations

import io
import stat
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("multipart")

from command_line import assert_one_line_error, run_cli  # noqa: E402
from serving import http, start_server  # noqa: E402

from flux_klein_mlx.errors import FluxKleinError  # noqa: E402
from flux_klein_mlx.serve import training_files  # noqa: E402
from flux_klein_mlx.serve.training_files import TrainingFiles, entry_parts  # noqa: E402


def png(seed: int, size=(64, 64)) -> bytes:
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def make_zip(entries: dict[str, bytes], links: tuple = ()) -> bytes:
    """A zip of `entries` (name -> bytes), with `links` as symbolic-link entries (Unix mode bits)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
        for name in links:
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            z.writestr(info, "/etc/passwd")
    return buf.getvalue()


def dataset(n: int = 2) -> dict[str, bytes]:
    """n captioned images, as `train --data` reads them (the captions of tests/train/test_settings.make_images)."""
    out = {}
    for i in range(n):
        out[f"im{i}.png"] = png(i)
        out[f"im{i}.txt"] = b"a test card"
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tmp_path_factory.mktemp("train-dir"), tmp_path_factory.mktemp("loras")


@pytest.fixture(scope="module")
def server(base, folders, tmp_path_factory):
    train_dir, lora_dir = folders
    args = ["--api-key", "test-key-123", "--train-dir", str(train_dir), "--lora-dir", str(lora_dir)]
    yield from start_server(base, [*args, "--model-id", "klein-base-tiny"], tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def upload(client, data: bytes, name: str = "data.zip"):
    return client.files.create(file=(name, data, "application/zip"), purpose="fine-tune")


# ---- files -------------------------------------------------------------------------------------------


def test_a_zip_is_checked_unpacked_listed_and_deleted(client, folders):
    """The file object is OpenAI's; the data lands as `train --data`/`--control` read it: a wrapper folder
    taken off, a kohya repeat folder kept, control folders apart; macOS's extras skipped."""
    entries = {f"set/{k}": v for k, v in dataset().items()}
    entries |= {"set/3_sks dog/im2.png": png(2), "set/3_sks dog/im2.txt": b"a dog", "set/.DS_Store": b"\0\1"}
    entries |= {"__MACOSX/set/._im0.png": b"\0\5\x16\7"}
    f = upload(client, make_zip(entries), "photos.zip")
    assert f.id.startswith("file-") and f.object == "file" and f.purpose == "fine-tune"
    assert f.filename == "photos.zip" and f.status == "processed" and f.bytes > 0 and f.created_at > 0
    folder = folders[0] / "files" / f.id
    assert sorted(p.relative_to(folder / "data").as_posix() for p in (folder / "data").rglob("*.*")) == [
        "3_sks dog/im2.png",
        "3_sks dog/im2.txt",
        "im0.png",
        "im0.txt",
        "im1.png",
        "im1.txt",
    ]
    assert (folder / "data" / "im1.png").read_bytes() == png(1)  # the bytes as sent, never re-encoded
    assert f.id in [g.id for g in client.files.list()]
    assert client.files.retrieve(f.id).filename == "photos.zip"
    assert client.files.delete(f.id).deleted
    assert not folder.exists()
    with pytest.raises(openai.NotFoundError, match="no file"):
        client.files.retrieve(f.id)


def test_control_folders_are_the_references_in_order(client, folders):
    entries = dataset() | {f"control_2/im{i}.png": png(10 + i) for i in range(2)}
    entries |= {f"control/im{i}.png": png(20 + i) for i in range(2)}
    f = upload(client, make_zip(entries))
    assert f.model_extra["controls"] == ["control", "control_2"] and f.model_extra["images"] == 6
    data, controls = TrainingFiles(folders[0]).folders(f.id)
    assert [c.name for c in controls] == ["control", "control_2"]
    assert (controls[1] / "im0.png").read_bytes() == png(10) and (data / "im0.png").is_file()


@pytest.mark.parametrize(
    "entries, links, words",
    [
        (dataset() | {"notes.pdf": b"%PDF-1.4"}, (), ["notes.pdf", "neither an image"]),
        (dataset() | {"im9.png": b"not a png at all"}, (), ["im9.png", "does not open"]),
        (dataset() | {"../evil.txt": b"x"}, (), ["../evil.txt", ".."]),
        (dataset() | {"/etc/evil.txt": b"x"}, (), ["evil.txt", "relative"]),  # the path shown as its last part
        (dataset() | {"a\\..\\evil.txt": b"x"}, (), ["relative"]),
        (dataset(), ("im0.webp",), ["im0.webp", "link"]),
        (dataset() | {"im0.txt": "a caf\xe9".encode("latin-1")}, (), ["im0.txt", "not UTF-8"]),
        ({"a/b/c/d.png": png(0)}, (), ["a/b/c/d.png", "N_name/ folders"]),
        ({"im0.txt": b"only a caption"}, (), ["no images"]),
    ],
)
def test_a_bad_zip_is_one_line_and_nothing_kept(client, folders, entries, links, words):
    before = sorted((folders[0] / "files").iterdir()) if (folders[0] / "files").exists() else []
    with pytest.raises(openai.BadRequestError) as e:
        upload(client, make_zip(entries, links))
    message = e.value.body["message"]
    assert "\n" not in message and all(w in message for w in words), message
    assert sorted((folders[0] / "files").iterdir()) == before  # nothing half written


@pytest.mark.parametrize(
    "body, words",
    [
        (dict(file=("data.zip", b"PK but not a zip"), purpose="fine-tune"), ["not a zip"]),
        (dict(file=("data.zip", make_zip(dataset())), purpose="assistants"), ["purpose", "fine-tune"]),
    ],
)
def test_a_bad_upload_is_one_line(client, body, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(**body)
    assert all(w in e.value.body["message"] for w in words)


def test_files_need_the_key(server):
    code, body = http("GET", server.url + "/v1/files")
    assert code == 401 and "API key" in body["error"]["message"]


@pytest.mark.parametrize("lora_dir, words", [(False, ["--train-dir needs --lora-dir"]), (True, ["nowhere"])])
def test_train_dir_is_checked_before_start(capsys, base, tmp_path, lora_dir, words):
    train_dir = tmp_path / ("nowhere" if lora_dir else "")
    args = ["serve", "--model", base, "--train-dir", train_dir, *(["--lora-dir", tmp_path] if lora_dir else [])]
    assert_one_line_error(*run_cli(capsys, *args)[::2], *words)


# ---- the zip's checks, in-process -----------------------------------------------------------------


def test_counts_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(training_files, "MAX_TRAINING_ENTRIES", 3)
    with pytest.raises(FluxKleinError, match="4 entries; the limit is 3"):
        TrainingFiles(tmp_path).add(io.BytesIO(make_zip(dataset(2))), "d.zip", 1)
    monkeypatch.setattr(training_files, "MAX_TRAINING_IMAGE_PIXELS", 64 * 63)
    with pytest.raises(FluxKleinError, match="64x64; the limit is"):
        TrainingFiles(tmp_path).add(io.BytesIO(make_zip(dataset(1))), "d.zip", 1)
    monkeypatch.setattr(training_files, "MAX_TRAINING_UNPACKED_BYTES", 100)
    with pytest.raises(FluxKleinError, match="unpacks to more than"):
        TrainingFiles(tmp_path).add(io.BytesIO(make_zip(dataset(1))), "d.zip", 1)
    assert not list((tmp_path / "files").iterdir())


NAME_TEXT = st.text(st.sampled_from("ab./\\:_-0 3.txtpng\xe9") | st.characters(exclude_characters="\0"), max_size=12)


@given(names=st.lists(NAME_TEXT.filter(bool), min_size=1, max_size=4))  # a NUL ends a name in zipfile's writer
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_names_unpack_inside_the_folder_or_are_one_line(tmp_path, names):
    """Whatever the names, the zip is refused in one line or every file lands under its folder."""
    root = tmp_path / "h"
    entries = {name: png(0) if name.lower().endswith(".png") else b"a caption" for name in names}
    try:
        record = TrainingFiles(root).add(io.BytesIO(make_zip(entries)), "d.zip", 1)
    except FluxKleinError as e:
        assert "\n" not in str(e)
        return
    folder = (root / "files" / record["id"]).resolve()
    for p in folder.rglob("*"):
        assert p.resolve().is_relative_to(folder) and not p.is_symlink()


@given(st.text(max_size=40))
@settings(max_examples=300, deadline=None)
def test_entry_names_are_parts_inside_or_refused(name):
    try:
        parts = entry_parts(name)
    except FluxKleinError as e:
        assert "\n" not in str(e)
        return
    assert parts and all(p not in ("", ".", "..") and "/" not in p and "\\" not in p for p in parts)
    assert not Path(*parts).is_absolute()
