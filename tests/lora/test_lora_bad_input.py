"""Bad LoRA files on the command line (issue 21): refused by the CLI before any model loads.

The kinds of bad file are test_lora.bad_lora_files (the API's refusals are in test_lora.py).
"""

from __future__ import annotations

import re

from command_line import assert_one_line_error, gen_args, tree_hash


def test_bad_lora_files_refused_by_the_cli_before_any_model(cli, snapshot, tmp_path, no_models):
    """Every kind of bad LoRA file of test_lora.bad_lora_files: one line naming the file, exit 1, no model
    loaded, the files untouched, no image written."""
    from test_lora import bad_lora_files

    folder = tmp_path / "loras"
    folder.mkdir()
    cases = bad_lora_files(folder)
    before = tree_hash(folder)
    out = tmp_path / "x.png"
    for name, lora, scale, match in cases:
        code, _, err = cli(*gen_args(snapshot, out, "--lora", lora, "--lora-scale", scale))
        assert_one_line_error(code, err)
        assert re.search(match, err), (name, err)
        assert lora.name in err, (name, err)
    assert no_models == [] and tree_hash(folder) == before and not out.exists()
