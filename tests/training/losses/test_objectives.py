"""Each objective is one class: ``TrainConfig.loss`` takes it by name, mapping or shorthand."""

from __future__ import annotations

import pytest

from pipeline.common.config import ConfigError, merge, parse_set, resolve
from training.config import TRAIN_PRESETS, TrainConfig, from_plain, to_plain
from training.losses.objectives import CLIPLossConfig, PCMEppLossConfig, ProLIPLossConfig


def _train(*sets: str) -> TrainConfig:
    return resolve(TRAIN_PRESETS, "demo", None, list(sets))


def test_a_new_name_starts_from_that_objectives_defaults():
    assert _train("loss.beta=2e-4").loss == ProLIPLossConfig(beta=2e-4)
    assert merge(_train("loss.beta=2e-4"), parse_set(["loss.name=clip"])).loss == CLIPLossConfig()
    assert _train("loss.name=pcmepp", "loss.alpha=0.2").loss == PCMEppLossConfig(alpha=0.2)


def test_the_shorthand_and_a_mapping_give_the_same_object():
    assert _train("loss=pcmepp:alpha=0.2,mix_fraction=0.5").loss == PCMEppLossConfig(
        alpha=0.2, mix_fraction=0.5
    )
    assert TrainConfig(loss={"name": "pcmepp", "alpha": 0.2}).loss == PCMEppLossConfig(alpha=0.2)
    assert PCMEppLossConfig(alpha=0.2).spec() == "pcmepp:alpha=0.2"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["loss.name=triplet"], "loss.name must be one of prolip, siglip, clip, pcmepp, got 'triplet'"),
        (["loss.name=clip", "loss.beta=1"], "unknown config key loss.beta (known: name)"),
        (["loss=pcmepp:alpha=-1"], "loss.alpha: input should be greater than or equal to 0"),
    ],
)
def test_a_bad_key_or_value_names_its_key_path(sets, message):
    with pytest.raises(
        ConfigError, match="^" + message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")
    ):
        _train(*sets)


def test_the_flat_form_of_older_configs_still_reads():
    flat = {"name": "pcmepp", "init_bias": -10.0, "alpha1": 1e-7, "beta": 2e-4, "pcme_alpha": 0.2,
            "pcme_beta": 1e-3, "mix_fraction": 0.5}  # fmt: skip
    assert TrainConfig(loss=flat).loss == PCMEppLossConfig(alpha=0.2, beta=1e-3, mix_fraction=0.5)
    assert TrainConfig(loss={**flat, "name": "prolip"}).loss == ProLIPLossConfig(beta=2e-4)
    assert _train("loss.name=pcmepp", "loss.pcme_alpha=0.3").loss.alpha == 0.3


def test_the_plain_form_round_trips_every_objective():
    for loss in (ProLIPLossConfig(c=10.0), CLIPLossConfig(), PCMEppLossConfig(alpha=0.3)):
        cfg = TrainConfig(loss=loss)
        assert from_plain(to_plain(cfg)) == cfg and to_plain(cfg)["loss"]["name"] == loss.name
