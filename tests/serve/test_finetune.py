"""Training over the API (issue 47), driven by the official `openai` client against a real `serve` of the
tiny Base model (and the tiny distilled one beside it): the files (a zip of images and captions, checked and
unpacked safely under --train-dir) and the fine-tuning jobs, judged by `train` itself: a job's LoRA equals
`train_lora`'s on the same data and settings, tensor for tensor; generating with its name equals the pipeline
with that file; cancel then resume equals the run uninterrupted.

Bad input is one line and a 4xx each: a zip holding a non-image, a zip-slip name, a link, a caption that is
not text, a file that is not a zip; the zip checks themselves are also driven by Hypothesis in-process.
"""

from __future__ import annotations

import base64
import io
import json
import stat
import urllib.request
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

import flux_klein_mlx  # noqa: E402
from flux_klein_mlx.errors import FluxKleinError  # noqa: E402
from flux_klein_mlx.serve import training_files  # noqa: E402
from flux_klein_mlx.serve.forms import ApiError  # noqa: E402
from flux_klein_mlx.serve.training_files import TrainingFiles, entry_parts  # noqa: E402
from flux_klein_mlx.serve.training_jobs import plan_job  # noqa: E402
from flux_klein_mlx.serve.training_requests import (  # noqa: E402
    check_fields,
    check_suffix,
    hyperparameters,
    merged,
    public_hyperparameters,
    training_options,
)
from flux_klein_mlx.train.settings import TrainSettings  # noqa: E402


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
def folders(tmp_path_factory, base):
    """The server's --train-dir and --lora-dir, and the tiny Base model's folder."""
    return tmp_path_factory.mktemp("train-dir"), tmp_path_factory.mktemp("loras"), Path(base)


@pytest.fixture(scope="module")
def server(base, distilled, base3, folders, tmp_path_factory):
    """The tiny FLUX.2 Base model served first (the one loaded), the distilled one beside it (a job refuses it)
    and the tiny FLUX 3 Base."""
    train_dir, lora_dir, _ = folders
    named = tmp_path_factory.mktemp("models")  # served models are named by their folders' last parts
    for name, folder in (("klein-base-tiny", base), ("klein-distilled-tiny", distilled), ("klein3-base-tiny", base3)):
        (named / name).symlink_to(folder, target_is_directory=True)
    args = ["--api-key", "test-key-123", "--train-dir", str(train_dir), "--lora-dir", str(lora_dir)]
    args += ["--model", named / "klein-distilled-tiny", "--model", named / "klein3-base-tiny"]
    yield from start_server(named / "klein-base-tiny", args, tmp_path_factory)


# what each job trains: the tiny model at 64 px, rank 4, a checkpoint every step (train's own test settings)
TRAINING = {"steps": 2, "rank": 4, "resolution": 64, "save_every": 1}


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


# ---- jobs ----------------------------------------------------------------------------------------------


def events_of(server, job_id: str) -> list[dict]:
    """Every event of a job, oldest first, followed over SSE until it ends."""
    url = f"{server.url}/v1/fine_tuning/jobs/{job_id}/events?stream=true"
    req = urllib.request.Request(url, headers=server.auth)
    out = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: "):
                if line.strip() == b"data: [DONE]":
                    return out
                out.append(json.loads(line[6:]))
    raise AssertionError("the stream ended without [DONE]")


def tensors(path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path)).items()}


def same_tensors(a, b) -> bool:
    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)


@pytest.fixture(scope="module")
def base_id(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def trained(server, client, base_id, folders):
    """One job of TRAINING on dataset(), followed to its end."""
    f = upload(client, make_zip(dataset()))
    job = client.fine_tuning.jobs.create(
        model=base_id, training_file=f.id, seed=3, suffix="fox", extra_body={"training": TRAINING}
    )
    assert job.status in ("queued", "validating_files", "running") and job.id.startswith("ftjob-")
    return job, events_of(server, job.id)


def test_a_job_is_train_with_those_settings(trained, client, folders, tmp_path):
    job, events = trained
    done = client.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded" and done.trained_tokens == 2 and done.error is None, done
    assert done.fine_tuned_model.startswith("ft-fox-") and done.seed == 3 and done.finished_at >= done.created_at
    steps = [e for e in events if e["type"] == "metrics"]
    assert [e["data"]["step"] for e in steps] == [1, 2] and all(e["data"]["train_loss"] > 0 for e in steps)
    assert all(e["data"]["learning_rate"] == pytest.approx(1e-4) for e in steps)
    assert any("checkpoint at step 2" in e["message"] for e in events)
    listed = [e.id for e in client.fine_tuning.jobs.list_events(job.id, limit=3)]  # paged, newest first
    assert listed == [e["id"] for e in events[::-1]]
    # the judge: train itself, on the same data and settings, in this process
    data = tmp_path / "data"
    zipfile.ZipFile(io.BytesIO(make_zip(dataset()))).extractall(data)
    ours = tmp_path / "ours.safetensors"
    list(flux_klein_mlx.train_lora(model=folders[2], data=data, output=ours, seed=3, **TRAINING))
    lora = folders[1] / f"{done.fine_tuned_model}.safetensors"
    assert same_tensors(lora, ours)
    work = folders[0] / "jobs" / job.id / "work"
    assert (work / "train.json").is_file() and (work / "loss.png").is_file()  # train's work folder
    assert not any(str(folders[0]) in json.dumps(e) for e in events)  # never the server's own folders


@pytest.fixture(scope="module")
def flux3_trained(server, client):
    """One FLUX 3 job of TRAINING on dataset(), with a validation file (the same images under other names), followed
    to its end: the job and its events. The held-out loss is measured apart from training (its own fixed noise), so
    the LoRA is train's without one; one job for the two tests below."""
    train, held_out = (
        upload(client, make_zip({f"v{k}": v for k, v in dataset().items()} if n else dataset())) for n in (0, 1)
    )
    job = client.fine_tuning.jobs.create(
        model="klein3-base-tiny",
        training_file=train.id,
        validation_file=held_out.id,
        seed=2,
        extra_body={"training": TRAINING},
    )
    return job, events_of(server, job.id)


def test_a_flux3_job_is_train_too(flux3_trained, client, base3, folders, tmp_path):
    job, _ = flux3_trained
    done = client.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded" and done.model == "klein3-base-tiny", done
    data = tmp_path / "data"
    zipfile.ZipFile(io.BytesIO(make_zip(dataset()))).extractall(data)
    ours = tmp_path / "ours.safetensors"
    list(flux_klein_mlx.train_lora(model=base3, data=data, output=ours, seed=2, **TRAINING))
    assert same_tensors(folders[1] / f"{done.fine_tuned_model}.safetensors", ours)


def test_a_validation_file_is_measured_at_each_checkpoint(flux3_trained):
    _, events = flux3_trained
    losses = [e["data"] for e in events if "valid_loss" in e["data"]]
    assert [d["step"] for d in losses] == [1, 2] and all(d["valid_loss"] > 0 for d in losses), losses


def test_checkpoints_are_usable_loras(trained, client, server):
    job, _ = trained
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [2, 1]
    names = [c.fine_tuned_model_checkpoint for c in checkpoints]
    assert set(names) <= set(server.status()["loras"])


def test_generation_with_the_fine_tuned_model_is_generation_with_its_file(trained, client, base_id, folders):
    job, _ = trained
    name = client.fine_tuning.jobs.retrieve(job.id).fine_tuned_model
    res = client.images.generate(
        model=base_id, prompt="a test card", size="64x64", extra_body={"seed": 5, "steps": 2, "loras": [name]}
    )
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json))).convert("RGB"))
    pipe = flux_klein_mlx.load(folders[2], loras=[folders[1] / f"{name}.safetensors"])
    ours = np.asarray(pipe.generate("a test card", width=64, height=64, seed=5, steps=2).convert("RGB"))
    assert np.array_equal(got, ours)
    tagged = client.images.generate(
        model=base_id, prompt=f"a test card <lora:{name}:1>", size="64x64", extra_body={"seed": 5, "steps": 2}
    )
    assert tagged.data[0].b64_json == res.data[0].b64_json


def job_files(folders) -> tuple:
    """What jobs left on the disk: their folders and the LoRA folder's files."""
    jobs = folders[0] / "jobs"
    return sorted(jobs.iterdir()) if jobs.is_dir() else [], sorted(folders[1].iterdir())


@pytest.mark.parametrize(
    "fields, error, words",
    [
        (dict(model="klein-distilled-tiny"), openai.BadRequestError, ["distilled", "Base"]),
        (dict(model="flux-pro"), openai.NotFoundError, ["not served"]),
        (dict(training_file="file-" + "0" * 24), openai.NotFoundError, ["no file", "POST /v1/files"]),
        (dict(extra_body={"training": {**TRAINING, "steps": 0}}), openai.BadRequestError, ["steps"]),
        (dict(extra_body={"training": {"data": "/etc"}}), openai.BadRequestError, ["'data'", "training_file"]),
        (dict(extra_body={"training": {"init_lora": "/x.safetensors"}}), openai.BadRequestError, ["init_lora"]),
        (dict(extra_body={"training": {"stepz": 2}}), openai.BadRequestError, ["stepz", "not one of train's"]),
        (dict(extra_body={"training": {"resolution": 65}}), openai.BadRequestError, ["resolution", "16"]),
        (
            dict(hyperparameters={"n_epochs": 2}, extra_body={"training": TRAINING}),
            openai.BadRequestError,
            ["not both"],
        ),
        (dict(hyperparameters={"learning_rate_multiplier": -1}), openai.BadRequestError, ["above 0"]),
        (dict(suffix="../up"), openai.BadRequestError, ["suffix"]),
        (dict(extra_body={"training": {**TRAINING, "sample_model": "/models/x"}}), openai.NotFoundError, ["served"]),
        (dict(extra_body={"training": TRAINING, "traning": {}}), openai.BadRequestError, ["traning"]),
    ],
)
def test_a_bad_job_is_one_line_and_leaves_nothing(client, base_id, folders, fields, error, words):
    f = upload(client, make_zip(dataset()))
    before = job_files(folders)
    body = dict(model=base_id, training_file=f.id) | fields
    with pytest.raises(error) as e:
        client.fine_tuning.jobs.create(**body)
    message = e.value.body["message"]
    assert "\n" not in message and all(w in message for w in words), message
    assert job_files(folders) == before
    client.files.delete(f.id)


def test_a_dry_run_is_the_plan_and_no_job(client, base_id, folders):
    """dry_run: train's checks and its memory plan (what the page shows before starting), no job made."""
    f = upload(client, make_zip(dataset()))
    before = job_files(folders)
    plan = client.fine_tuning.jobs.create(
        model=base_id, training_file=f.id, extra_body={"training": TRAINING, "dry_run": True}
    )
    extra = plan.model_extra
    assert plan.object == "fine_tuning.job.plan" and extra["images"] == 2 and extra["steps"] == 2
    assert extra["memory"]["fits"] and extra["memory"]["peak"] > 0 and "GB" in extra["memory"]["description"]
    assert job_files(folders) == before
    with pytest.raises(openai.BadRequestError, match="steps"):
        client.fine_tuning.jobs.create(
            model=base_id, training_file=f.id, extra_body={"training": {**TRAINING, "steps": 0}, "dry_run": True}
        )


def wait_for(server, job_id: str, test, timeout: float = 120) -> dict:
    """The job's events (over SSE) until `test(event)` holds; the event it held for."""
    url = f"{server.url}/v1/fine_tuning/jobs/{job_id}/events?stream=true"
    with urllib.request.urlopen(urllib.request.Request(url, headers=server.auth), timeout=timeout) as r:
        for line in r:
            if line.startswith(b"data: {") and test(event := json.loads(line[6:])):
                return event
    raise AssertionError(f"the job {job_id} ended before the event awaited")


def generate(server, **body):
    """POST /v1/images/generations without the client: (status, JSON)."""
    data = json.dumps({"prompt": "x", "size": "64x64", **body}).encode()
    return http(
        "POST", server.url + "/v1/images/generations", data, {**server.auth, "Content-Type": "application/json"}
    )


def test_a_job_waits_behind_images_and_images_wait_out_a_job(server, client, base_id):
    """A job created while an image is made is queued behind it; meanwhile a second job and an image request are
    429 (the image's with the job's id and Retry-After 60); the queued job cancelled is cancelled at once, never
    started; once it is, images are made again."""
    f = upload(client, make_zip(dataset()))
    req = urllib.request.Request(
        server.url + "/v1/images/generations",
        data=json.dumps({"prompt": "slow", "size": "64x64", "steps": 200, "seed": 1, "stream": True}).encode(),
        headers={**server.auth, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        while not r.readline().startswith(b"event: image_generation.progress"):
            pass  # the image is being made
        waiting = client.fine_tuning.jobs.create(model=base_id, training_file=f.id, extra_body={"training": TRAINING})
        assert waiting.status == "queued"
        with pytest.raises(openai.RateLimitError, match="1 fine-tuning jobs are queued or running") as e:
            client.fine_tuning.jobs.create(model=base_id, training_file=f.id, extra_body={"training": TRAINING})
        assert e.value.response.headers["Retry-After"] == "60"
        code, body = generate(server)
        assert code == 429 and waiting.id in body["error"]["message"], body
        assert body["error"]["code"] == "fine_tuning_job_running"
        cancelled = client.fine_tuning.jobs.cancel(waiting.id)
        assert cancelled.status == "cancelled" and cancelled.trained_tokens == 0
    server.wait_idle()
    assert generate(server, steps=1)[0] == 200
    assert not any(e.message.startswith("training") for e in client.fine_tuning.jobs.list_events(waiting.id))


def test_cancel_then_resume_is_the_job_uninterrupted(server, client, base_id, folders):
    """A job cancelled after its first checkpoint stops there (an image request meanwhile is 429); resumed, it
    ends with the LoRA of the same job run uninterrupted, tensor for tensor."""
    f = upload(client, make_zip(dataset()))
    long = {**TRAINING, "steps": 10, "save_every": 2}  # cancelled at its first checkpoint: 8 steps to spare
    create = lambda: client.fine_tuning.jobs.create(  # noqa: E731
        model=base_id, training_file=f.id, seed=1, extra_body={"training": long}
    )
    first = create()
    assert generate(server)[0] == 429
    wait_for(server, first.id, lambda e: "checkpoint at step 2" in e["message"])
    stopped = client.fine_tuning.jobs.cancel(first.id)
    assert stopped.status == "cancelled" and 2 <= stopped.trained_tokens < 10, stopped
    kept = [c.step_number for c in client.fine_tuning.jobs.checkpoints.list(first.id)]
    assert kept[-1] == 2 and stopped.trained_tokens - kept[0] < 2, kept  # the last one kept
    assert client.fine_tuning.jobs.resume(first.id).status == "queued"
    events = events_of(server, first.id)
    assert any(f"resuming at step {kept[0] + 1}" in e["message"] for e in events)
    whole = create()
    events_of(server, whole.id)
    a, b = (client.fine_tuning.jobs.retrieve(j.id) for j in (first, whole))
    assert a.status == b.status == "succeeded" and a.trained_tokens == b.trained_tokens == 10
    assert same_tensors(
        folders[1] / f"{a.fine_tuned_model}.safetensors", folders[1] / f"{b.fine_tuned_model}.safetensors"
    )


def test_samples_are_served_as_the_events_name_them_and_warnings_are_events(server, client, base_id):
    f = upload(client, make_zip(dataset()))
    training = {**TRAINING, "steps": 1, "sample_every": 1, "sample_prompts": ["a test card"], "sample_steps": 1}
    training.update(lr=1e-9, sample_model="klein-distilled-tiny")  # train warns that 1e-9 cannot move the adapters
    job = client.fine_tuning.jobs.create(model=base_id, training_file=f.id, extra_body={"training": training})
    events = events_of(server, job.id)
    assert any(e["level"] == "warn" and "too small" in e["message"] for e in events), events
    samples = [name for e in events for name in e["data"].get("samples", [])]
    assert samples and all(name.endswith(".png") for name in samples)
    code, body = http("GET", f"{server.url}/v1/fine_tuning/jobs/{job.id}/samples/{samples[-1]}", headers=server.auth)
    assert code == 200 and Image.open(io.BytesIO(body)).size == (64, 64)
    for bad in ("train.json", "../job.json", "..%2Fjob.json"):
        code, body = http("GET", f"{server.url}/v1/fine_tuning/jobs/{job.id}/samples/{bad}", headers=server.auth)
        assert code == 404, (bad, body)


def test_a_restarted_server_lists_its_jobs_and_files(base, tmp_path_factory):
    """A server killed while a job runs: restarted on the same folders it lists the files and the jobs, the
    finished one as it was, the interrupted one failed ("server_stopped"), which resumes from its checkpoint."""
    train_dir, lora_dir = tmp_path_factory.mktemp("train-dir"), tmp_path_factory.mktemp("loras")
    args = ["--api-key", "test-key-123", "--train-dir", str(train_dir), "--lora-dir", str(lora_dir)]
    first = start_server(base, args, tmp_path_factory)
    server = next(first)
    client = server.client()
    model = client.models.list().data[0].id
    f = upload(client, make_zip(dataset()))
    done = client.fine_tuning.jobs.create(model=model, training_file=f.id, extra_body={"training": TRAINING})
    events_of(server, done.id)
    cut = client.fine_tuning.jobs.create(
        model=model, training_file=f.id, extra_body={"training": {**TRAINING, "steps": 1000}}
    )
    wait_for(server, cut.id, lambda e: "checkpoint at step 1" in e["message"])
    server.proc.kill()
    server.proc.wait(15)
    next(first, None)
    second = start_server(base, args, tmp_path_factory)
    server = next(second)
    client = server.client()
    assert [g.id for g in client.files.list()] == [f.id]
    jobs = {j.id: j for j in client.fine_tuning.jobs.list()}
    assert jobs.keys() == {done.id, cut.id}
    assert (
        jobs[done.id].status == "succeeded" and (lora_dir / f"{jobs[done.id].fine_tuned_model}.safetensors").is_file()
    )
    assert jobs[cut.id].status == "failed" and jobs[cut.id].error.code == "server_stopped", jobs[cut.id]
    assert "/resume" in jobs[cut.id].error.message
    kept = client.fine_tuning.jobs.checkpoints.list(cut.id).data[0].step_number
    assert client.fine_tuning.jobs.resume(cut.id).status == "queued"
    wait_for(server, cut.id, lambda e: e["message"].startswith(f"resuming at step {kept + 1}"))
    assert client.fine_tuning.jobs.cancel(cut.id).status == "cancelled"
    next(second, None)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
OPTIONS = st.sampled_from(sorted(TrainSettings.__dataclass_fields__)) | st.text(max_size=8)


def test_openai_hyperparameters_are_trains_options():
    """n_epochs is --epochs, batch_size --batch-size, learning_rate_multiplier times --lr's default; "auto" leaves
    train's default; the same, given in method.supervised, too; the job shows them back as OpenAI names them."""
    given = {"n_epochs": 3, "batch_size": 2, "learning_rate_multiplier": 2.5}
    options = {"epochs": 3, "batch_size": 2, "lr": 2.5 * TrainSettings.lr}
    assert hyperparameters({"hyperparameters": given}) == options
    assert hyperparameters({"method": {"type": "supervised", "supervised": {"hyperparameters": given}}}) == options
    assert hyperparameters({"hyperparameters": {"n_epochs": "auto", "learning_rate_multiplier": "auto"}}) == {}
    shown = public_hyperparameters(merged(options, {"rank": 8}))
    assert shown == {"n_epochs": 3, "batch_size": 2, "learning_rate_multiplier": pytest.approx(2.5)}


@given(
    body=st.fixed_dictionaries(
        {},
        optional={
            "training": st.dictionaries(OPTIONS, JSON, max_size=4) | JSON,
            "hyperparameters": st.dictionaries(
                st.sampled_from(["n_epochs", "batch_size", "learning_rate_multiplier", "x"]), JSON, max_size=3
            )
            | JSON,
            "suffix": JSON,
            "seed": JSON,
            "method": JSON,
            "metadata": JSON,
        },
    )
)
@settings(max_examples=200, deadline=None)
def test_any_job_body_maps_to_train_settings_or_is_one_line(body):
    """Whatever a client sends, the job's settings are `train`'s checked ones or one 4xx line; never a crash."""
    try:
        check_fields(body)
        check_suffix(body.get("suffix"))
        options = merged(hyperparameters(body), training_options(body.get("training")))
        plan_job({**options, "data": "/nowhere/data", "output": "/nowhere/x.safetensors"})
    except ApiError as e:
        assert 400 <= e.status < 500 and "\n" not in e.message
        return
    raise AssertionError("a job with a missing data folder was planned")


def in_process_app(options):
    """The app in this process (no model: these requests never reach the worker)."""
    from starlette.testclient import TestClient

    from flux_klein_mlx.serve.api import create_app
    from flux_klein_mlx.serve.jobs import Worker

    return TestClient(create_app(Worker(lambda: None), options))


def test_without_train_dir_the_routes_say_how_to_start():
    from flux_klein_mlx.serve.api import ServerOptions

    app = in_process_app(ServerOptions())
    for method, path in [("GET", "/v1/files"), ("POST", "/v1/fine_tuning/jobs"), ("GET", "/v1/fine_tuning/jobs/x")]:
        r = app.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == 400 and "--train-dir" in r.json()["error"]["message"], (path, r.text)


def test_a_zip_past_the_upload_bound_is_413_before_it_is_read(monkeypatch, tmp_path):
    from flux_klein_mlx.serve import guard
    from flux_klein_mlx.serve.api import ServerOptions

    monkeypatch.setattr(guard, "MAX_TRAINING_UPLOAD_BYTES", 1000)
    app = in_process_app(ServerOptions(train_dir=tmp_path, lora_dir=tmp_path))
    big = make_zip(dataset() | {"big.png": np.random.default_rng(0).bytes(2 << 20)})  # past the bound + 1 MB of form
    r = app.post("/v1/files", files={"file": ("d.zip", big)}, data={"purpose": "fine-tune"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    assert not (tmp_path / "files").exists() or not list((tmp_path / "files").iterdir())


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


# A zip names its entries in UTF-8 (or cp437): a lone surrogate cannot be written into one, nor a NUL kept.
NAME_CHARS = st.characters(exclude_characters="\0", exclude_categories=("Cs",))
NAME_TEXT = st.text(st.sampled_from("ab./\\:_-0 3.txtpng\xe9") | NAME_CHARS, max_size=12)


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
