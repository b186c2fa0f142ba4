"""benchmarks/check_real_weights.py runs end to end on the tiny snapshot (so it cannot rot), and on
a faithful pipeline it reports agreement: float32 parity gives tiny errors and a high PSNR."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from PIL import Image
from tiny_model import shared_tiny_snapshot

REPO = Path(__file__).resolve().parents[1]


def test_check_script_on_the_tiny_snapshot(tmp_path_factory, tmp_path, capsys):
    snapshot = shared_tiny_snapshot(tmp_path_factory, distilled=True)
    out = tmp_path / "pngs"
    # In this process (a child only paid the imports again, ~5 s): the script's main() is what its command runs.
    spec = importlib.util.spec_from_file_location("check_real_weights", REPO / "benchmarks" / "check_real_weights.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["--model", str(snapshot), "--size", "64", "--seed", "5", "--device", "cpu", "--output-dir", str(out)]
    returncode = script.main(args)
    captured = capsys.readouterr()
    assert returncode == 0, captured.err[-3000:]
    text = captured.out
    print(text)  # shown with -s: the report a user would see
    assert "machine:" in text and "versions:" in text and "diffusers float32 on cpu" in text
    rows = {
        m[0]: [float(x) for x in m[1:]]
        for m in re.findall(r"^(text-to-image|edit|img2img)\s+\d+x\d+\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", text, re.M)
    }
    assert set(rows) == {"text-to-image", "edit", "img2img"}, text
    for case, (emb, vel, lat, psnr) in rows.items():
        assert emb < 1e-4 and vel < 1e-3 and lat < 1e-3 and psnr > 50, (case, text)
    for case in rows:
        with Image.open(out / f"{case}.png") as im:
            assert im.size == (128, 64)  # diffusers | ours, 64x64 each
