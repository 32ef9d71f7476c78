import pytest

from pipeline.config import BUILD_PRESETS, BuildConfig, ConfigError, merge, parse_set, resolve


def test_set_overrides_nested_and_typed():
    cfg = resolve(BUILD_PRESETS, "demo", sets=["download.timeout_s=2.5", "dedupe.near_duplicates=false"])
    assert cfg.download.timeout_s == 2.5
    assert cfg.dedupe.near_duplicates is False
    assert BUILD_PRESETS["demo"].download.timeout_s == 1.0  # presets are not mutated


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="download.timeout"):
        resolve(BUILD_PRESETS, "demo", sets=["download.timeout=3"])


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match="samples_per_shard"):
        merge(BuildConfig(), {"samples_per_shard": "many"})
    with pytest.raises(ConfigError, match="near_duplicates"):
        merge(BuildConfig(), {"dedupe": {"near_duplicates": "perhaps"}})


def test_list_values_from_cli():
    cfg = resolve(BUILD_PRESETS, "demo", sets=["filters.names=[basic, english]"])
    assert cfg.filters.names == ["basic", "english"]
    cfg = resolve(BUILD_PRESETS, "demo", sets=["filters.names=basic,english"])
    assert cfg.filters.names == ["basic", "english"]


def test_yaml_file_layer(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("samples_per_shard: 7\ndownload:\n  retries: 0\n")
    cfg = resolve(BUILD_PRESETS, "demo", config_file=str(f), sets=["samples_per_shard=9"])
    assert cfg.samples_per_shard == 9 and cfg.download.retries == 0


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset"):
        resolve(BUILD_PRESETS, "nope")


def test_parse_set_rejects_missing_equals():
    with pytest.raises(ConfigError):
        parse_set(["oops"])


@pytest.mark.parametrize(
    ("key", "value"), [("data.cache_decoded", "true"), ("scaling.torch_threads", -2), ("run.log_every", 0)]
)
def test_train_config_range_errors_name_the_field(key, value):
    from training.config import TRAIN_PRESETS, validate

    cfg = resolve(TRAIN_PRESETS, "demo", None, [f"{key}={value}"])
    with pytest.raises(ConfigError, match=key.split(".")[-1]):
        validate(cfg)
