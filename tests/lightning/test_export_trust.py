"""nereus-export trusts nothing in a checkpoint: no link followed out of it, nothing written outside
``output``, no custom code, no family transformers would have to guess, sizes checked before allocation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nereus_lightning.lightning.hf_export import export_hf
from nereus_lightning.spec.errors import CheckpointError, NereusConfigError
from tests.helpers import launch_env
from tests.lightning.test_checkpoint_safety import copy_of, forge, saved  # noqa: F401 (the fixture)

pytestmark = pytest.mark.distributed


def edit_config(ckpt: Path, **changes: object) -> None:
    """Change ``hf/actor/config.json`` (None: drop the key) and re-record the hashes (a forged checkpoint)."""
    file = ckpt / "hf" / "actor" / "config.json"
    config = {**json.loads(file.read_text()), **changes}
    file.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    forge(ckpt)


def test_a_verified_checkpoint_exports_and_reloads(saved, tmp_path):  # noqa: F811
    import transformers as tf

    done = export_hf(str(saved / "s2.ckpt"), str(tmp_path / "out"))
    assert set(done) == {"actor", "critic"}
    assert tf.AutoModelForCausalLM.from_pretrained(done["actor"]).config.model_type == "llama"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["actor", "critic"]  # no staging left


@pytest.mark.parametrize("link", ["hf/actor/generation_config.json", "hf/actor", "hf"])
def test_links_out_of_the_checkpoint_are_refused_and_nothing_is_copied(saved, tmp_path, link):  # noqa: F811
    ckpt = copy_of(saved, tmp_path)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "passwd").write_text("root:x:0:0")
    (secret / "config.json").write_text("{}")
    path = ckpt / link
    if path.is_dir():
        import shutil

        shutil.rmtree(path)
    else:
        path.unlink()
    path.symlink_to(secret / "passwd" if link.endswith(".json") else secret)
    with pytest.raises(CheckpointError, match=rf"{link}: a symbolic link"):
        export_hf(str(ckpt), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert sorted(p.name for p in secret.iterdir()) == ["config.json", "passwd"]  # untouched


def test_nothing_is_written_outside_output(saved, tmp_path):  # noqa: F811
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / "actor").symlink_to(outside)  # a link where a model folder goes is replaced, not followed
    export_hf(str(saved / "s2.ckpt"), str(out))
    assert [p.name for p in outside.iterdir()] == ["keep.txt"] and (
        outside / "keep.txt"
    ).read_text() == "mine"
    assert (out / "actor").is_dir() and not (out / "actor").is_symlink()
    with pytest.raises(NereusConfigError, match="output: .* lies inside the checkpoint"):
        export_hf(str(saved / "s2.ckpt"), str(saved / "s2.ckpt" / "hf"))


def test_custom_code_and_unknown_families_are_refused_before_transformers_reads_them(
    saved,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    import transformers as tf

    def asked(*args: object, **kwargs: object) -> None:
        raise AssertionError("transformers was asked to read the config")

    monkeypatch.setattr(tf.AutoConfig, "from_pretrained", asked)
    monkeypatch.setattr(tf.AutoConfig, "for_model", asked)
    ckpt = copy_of(saved, tmp_path)
    edit_config(ckpt, auto_map={"AutoConfig": "evil.EvilConfig"})
    with pytest.raises(CheckpointError, match=r"hf/actor/config\.json: auto_map names custom model code"):
        export_hf(str(ckpt), str(tmp_path / "a"))
    edit_config(ckpt, auto_map=None)
    edit_config(ckpt, model_type="evil")
    with pytest.raises(NereusConfigError, match=r"config\.json: model family 'evil' is not supported"):
        export_hf(str(ckpt), str(tmp_path / "b"))


def test_a_config_whose_sizes_the_tensors_do_not_have_is_refused_before_allocation(saved, tmp_path):  # noqa: F811
    ckpt = copy_of(saved, tmp_path)
    edit_config(ckpt, intermediate_size=10**9)  # a 10^9-wide MLP: 10^11 parameters if it were built
    with pytest.raises(
        CheckpointError, match=r"config\.json: gives model\.layers\.0\.mlp\.\w+_proj\.weight the shape"
    ):
        export_hf(str(ckpt), str(tmp_path / "out"))
    assert list((tmp_path / "out").iterdir()) == []  # the half-written folder went with the failure


def test_nereus_export_fails_in_one_line(saved, tmp_path):  # noqa: F811
    ckpt = copy_of(saved, tmp_path)
    (ckpt / "hf").rename(ckpt / "hf.real")
    (ckpt / "hf").symlink_to(ckpt / "hf.real")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nereus_lightning.cli.export",
            f"ckpt_path={ckpt}",
            f"output={tmp_path / 'o'}",
        ],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"nereus-export: {ckpt / 'hf'}: a symbolic link (to '{ckpt / 'hf.real'}'); "
        "a checkpoint is read from its own files only: replace the link by a copy of "
        "what it points to"
    ]
