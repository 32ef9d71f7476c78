"""The track beside DataComp's numbers, on the tiny track run once per session (tests/fixtures/tiny_track.py):
the CLIP L/14-score control and its same-fraction verdict, DataComp's five-number view, a submission folder
per subset whose exported checkpoint open_clip itself loads (a CLIP trained through the trainer, compared
with open_clip's own ``create_model_and_transforms``), the locked recipe, and a second track started from
the tiny track's shards and an imported scorer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.fixtures import open_clip_real

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TOL = 1e-5

_LOCAL_DIR_ENCODE = """
import numpy as np, torch
folder, images, tokens, out = sys.argv[1:]
model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + folder)
model.eval()
with torch.no_grad():
    img = model.encode_image(torch.from_numpy(np.load(images)), normalize=True)
    txt = model.encode_text(torch.from_numpy(np.load(tokens)), normalize=True)
np.savez(out, image=img.numpy(), text=txt.numpy())
"""


def test_report_has_the_l14_control_the_datacomp_view_and_a_submission_per_subset(tiny_track):
    out = tiny_track.out
    report = (out / "report.md").read_text()
    results = json.loads((out / "track_results.json").read_text())
    subsets = [r["subset"] for r in results["table"]]
    assert "clip_score_l14" in subsets and "| clip_score_l14 | " in report
    # DataComp's CLIP L/14 score at CSD's fraction, compared seed by seed (ProLIP Table C.7)
    assert "- csd vs clip_score_l14 (same fraction): **" in report
    assert "csd_vs_clip_score_l14" in results["verdict"] and "csd vs clip_score_l14 (same fraction): " in (
        tiny_track.printed
    )
    l14 = next(r for r in results["table"] if r["subset"] == "clip_score_l14")
    csd = next(r for r in results["table"] if r["subset"] == "csd")
    assert 0 < l14["size"] < next(r["size"] for r in results["table"] if r["subset"] == "no_filter")
    assert csd["size"] > 0 and results["unofficial"] is False
    # the five numbers above the per-task table; the demo's task list has only retrieval and the average
    head = "| subset | ImageNet | ImageNet dist. shifts | VTAB | Retrieval | Average |"
    assert head in report and report.index(head) < report.index("| subset | size | downloaded |")
    assert "Not in this task list: ImageNet, ImageNet dist. shifts, VTAB" in report
    view = {r["subset"]: r for r in results["datacomp_view"]}
    assert view["csd"]["average"] == pytest.approx(csd["average"])
    # submission/<subset>/ for every subset: what evaluate.py --submit packages
    for name in subsets:
        root = out / "submission" / name
        assert (root / "samples" / f"{name}.npy").read_bytes() == Path(_subset_path(out, name)).read_bytes()
        assert (root / "results.jsonl").read_text() == (
            out / "eval" / f"{name}-seed0" / "eval_results.jsonl"
        ).read_text()
        fields = yaml.safe_load((root / "submission.yaml").read_text())
        assert (
            fields["track"] == "filtering" and fields["method_name"] == name and fields["unofficial"] is False
        )
        assert fields["dataset_size"] == next(r["size"] for r in results["table"] if r["subset"] == name)
        assert fields["checkpoint"] == "checkpoint/open_clip_model.safetensors" and fields["main_metrics"]
        assert (root / "checkpoint" / "open_clip_model.safetensors").is_file()


def _subset_path(out: Path, name: str) -> str:
    state = json.loads((out / "track_state.json").read_text())
    return state["filters"][name]["path"]


def test_a_trained_clip_exported_loads_in_open_clip_with_our_embeddings(tiny_track, tmp_path):
    """The tiny track's no_filter model — a CLIP trained through the trainer — exported by the track,
    loaded by open_clip's ``create_model_and_transforms`` and imported back."""
    from training.imports.load import import_checkpoint
    from training.model.checkpoint import load_checkpoint

    out = tiny_track.out
    state = json.loads((out / "track_state.json").read_text())
    ckpt = state["train/no_filter-seed0"]["checkpoint"]
    model, cfg, tok = load_checkpoint(ckpt)
    model.eval()
    export = out / "submission" / "no_filter" / "checkpoint"
    config = json.loads((export / "open_clip_config.json").read_text())
    assert (
        config["model_cfg"]["text_cfg"]["pool_type"] == "eos" and config["prolip_ray"]["unofficial"] is False
    )
    images = torch.randn(4, 3, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(0))
    tokens = torch.from_numpy(tok.encode_batch(["a red circle", "a small blue square on grey", "", "!"], 32))
    np.save(tmp_path / "images.npy", images.numpy())
    np.save(tmp_path / "tokens.npy", tokens.numpy())
    open_clip_real.run_or_skip(
        _LOCAL_DIR_ENCODE, str(export), str(tmp_path / "images.npy"), str(tmp_path / "tokens.npy"),
        str(tmp_path / "theirs.npz"),
    )  # fmt: skip
    theirs = np.load(tmp_path / "theirs.npz")
    with torch.no_grad():
        img, txt = model.encode_image(images)[0].numpy(), model.encode_text(tokens)[0].numpy()
    assert np.abs(img - theirs["image"]).max() <= TOL and np.abs(txt - theirs["text"]).max() <= TOL
    back, cfg2, _ = load_checkpoint(import_checkpoint(f"openclip:tiny:{export}", str(tmp_path / "back")))
    assert cfg2 == cfg
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_recipe_change_stops_in_one_line_naming_the_key(tiny_track, capsys):
    from jobs.track.cli import main

    assert main([*tiny_track.args, "--set", "train.optim.lr=0.001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.optim.lr: 0.0005 → 0.001 changes the fixed tiny recipe" in err[0]
    assert "unofficial=true" in err[0]


def test_track_from_existing_shards_and_an_imported_scorer(tiny_track, tmp_path, capsys):
    """No build and no scorer training: the tiny track's shards (our build's) and its no_filter model as an
    open_clip scorer; a changed recipe runs as an unofficial track and says so everywhere."""
    from jobs.track.cli import main

    out, src = tmp_path / "started", tiny_track.out
    args = [
        "--preset", "tiny", "--set", f"output={out}", "--set", f"start_shards={src / 'shards'}",
        "--set", f"start_scorer=openclip:tiny:{src / 'submission' / 'no_filter' / 'checkpoint'}",
        "--set", "subsets=[no_filter,scorer_cosine]", "--set", "train.samples_seen=64",
        "--set", "unofficial=true", "--set", f"eval_root={src / 'pool' / 'eval'}",
    ]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    state = json.loads((out / "track_state.json").read_text())
    assert state["build"]["adopted_from"] == str(src / "shards")
    assert state["scorer"]["imported_from"].startswith("openclip:tiny:")
    assert not (out / "shards").exists() and not (out / "train" / "scorer").exists()
    assert "existing shards" in printed and "not trained here" in printed
    n = state["build"]["n_input"]
    assert n == json.loads((src / "track_results.json").read_text())["table"][0]["downloaded"]
    assert state["filters"]["no_filter"]["size"] == n
    report = (out / "report.md").read_text()
    assert report.splitlines()[0].startswith("**UNOFFICIAL RUN** (unofficial=true)")
    assert "train.samples_seen: 256 → 64" in report.splitlines()[0]
    results = json.loads((out / "track_results.json").read_text())
    assert results["unofficial"] is True and results["recipe_changes"] == ["train.samples_seen: 256 → 64"]
    fields = yaml.safe_load((out / "submission" / "scorer_cosine" / "submission.yaml").read_text())
    assert fields["unofficial"] is True
    export = json.loads(
        (out / "submission" / "no_filter" / "checkpoint" / "open_clip_config.json").read_text()
    )
    assert export["prolip_ray"]["unofficial"] is True
