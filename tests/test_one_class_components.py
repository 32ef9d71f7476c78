"""A new filter and a new loss are one class each (tests/fixtures/one_class_components.py, no other file
touched): --help-config lists them, the spec shorthand reaches them, and the build, training and track
configs take them."""

from __future__ import annotations

import importlib
import sys

import pyarrow as pa
import pytest

from pipeline.common.components import Component
from pipeline.common.config import ConfigError, merge, resolve

FIXTURE = "tests.fixtures.one_class_components"


@pytest.fixture
def fixture():
    """The fixture module, imported fresh; its classes leave the registries afterwards."""
    importlib.import_module("pipeline.filters.registry")  # the families' own members, registered first
    importlib.import_module("training.losses.objectives")
    before = {family: dict(members) for family, members in Component._members.items()}
    sys.modules.pop(FIXTURE, None)
    yield importlib.import_module(FIXTURE)
    sys.modules.pop(FIXTURE, None)
    for family, members in Component._members.items():
        for name in set(members) - set(before.get(family, {})):
            del members[name]


def _help(job, argv, capsys):
    module = importlib.import_module(f"jobs.{job}")
    main = module.main if hasattr(module, "main") else importlib.import_module(f"jobs.{job}.cli").main
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help-config"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_config_lists_the_new_filter_and_loss_with_their_parameters(fixture, capsys):
    build = _help("build_dataset", ["--preset", "demo"], capsys)
    assert "  caption_band: Captions whose word count lies in a band." in build
    assert "    min_words = 2  (int >= 0)\n      fewest words kept" in build
    train = _help("train", ["--preset", "demo"], capsys)
    assert "  toy: A toy objective: the weighted squared distance of matched means." in train
    assert "    weight = 1.0  (float > 0)\n      the toy term's weight" in train
    track = _help("track", ["--preset", "tiny"], capsys)
    assert "  caption_band: " in track and "  toy: " in track


def test_the_spec_shorthand_builds_and_runs_the_new_filter(fixture):
    from pipeline.config import BUILD_PRESETS
    from pipeline.filters.specs import apply_filters, parse_filter_specs

    cfg = resolve(
        BUILD_PRESETS, "demo", sets=["filters.names=[no_filter, 'caption_band:min_words=3,max_words=4']"]
    )
    (spec,) = parse_filter_specs(cfg.filters.names[1:])
    assert spec.filters == [fixture.CaptionLengthBand(min_words=3, max_words=4)]
    table = pa.table(
        {"uid": ["a", "b", "c"], "text": ["a dog", "a dog on grass", "a dog on the green grass"]}
    )
    res = apply_filters(table, cfg.filters)["caption_band"]
    assert res.keep.tolist() == [False, True, False]
    assert res.reason.tolist() == ["caption_too_short", "", "caption_too_long"]
    with pytest.raises(ConfigError, match=r"filters\.names\[0\]\.min_words: input should be greater than"):
        resolve(BUILD_PRESETS, "demo", sets=["filters.names=caption_band:min_words=-1"])


def test_the_spec_shorthand_builds_and_trains_with_the_new_loss(fixture):
    import torch

    from training.config import TRAIN_PRESETS
    from training.losses.registry import build_loss_from_config, logit_scalars

    cfg = resolve(TRAIN_PRESETS, "demo", sets=["loss=toy:weight=2"])
    assert cfg.loss == fixture.ToyLossConfig(weight=2.0) and not cfg.loss.probabilistic
    assert merge(cfg, {"loss": {"name": "clip"}}).loss.name == "clip"
    loss, spec = build_loss_from_config(cfg.loss)
    mu_v, mu_t = torch.eye(3), torch.eye(3).flip(0)
    out = loss(mu_v, None, mu_t, None)
    assert set(out) == {*spec.terms, "total"} and out["total"].item() == pytest.approx(2 * 4 / 3)
    assert logit_scalars(loss, spec) == (1.0, 0.0)


def test_the_track_takes_the_new_filter_as_a_subset_and_the_new_loss_as_a_recipe(fixture):
    from jobs.track.config import TRACK_PRESETS

    band = "caption_band:min_words=3,label=band"
    base = TRACK_PRESETS["tiny"]
    cfg = merge(base, {"build": {"filters": {"names": [*base.build.filters.names, band]}},
                       "subsets": [*base.subsets, "band"], "scorer": {"samples_seen": 512},
                       "unofficial": True, "train": {"loss": "toy:weight=0.5"}})  # fmt: skip
    assert "band" in cfg.subsets and cfg.train.loss == fixture.ToyLossConfig(weight=0.5)
    with pytest.raises(ConfigError, match=r"subsets: \['bnad'\] are neither"):
        merge(cfg, {"subsets": [*base.subsets, "bnad"]})
    assert set(base.subsets) <= set(cfg.subsets)
