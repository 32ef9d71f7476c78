import pytest

from pipeline.common.config import ConfigError, merge, parse_set, resolve
from pipeline.config import BUILD_PRESETS, BuildConfig


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
    ("key", "value"),
    [
        ("data.cache_decoded", "true"),
        ("scaling.torch_threads", -2),
        ("run.log_every", 0),
        ("data.text_mask_mode", "blank"),
        ("model", "demo-32px-cnn"),  # the demo preset trains ProLIP, which the CNN tower cannot carry
    ],
)
def test_train_config_range_errors_name_the_field(key, value):
    from training.config import TRAIN_PRESETS

    with pytest.raises(ConfigError, match=key.split(".")[-1]):
        resolve(TRAIN_PRESETS, "demo", None, [f"{key}={value}"])


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("download.image_size=0", "download.image_size"),
        ("download.timeout_s=-1", "download.timeout_s"),
        ("download.timeout_s=.nan", "download.timeout_s"),
        ("download.timeout_s=.inf", "download.timeout_s"),
        ("download.threads_per_actor=0", "download.threads_per_actor"),
        ("download.max_bytes=-1", "download.max_bytes"),
        ("download.jpeg_quality=500", "download.jpeg_quality"),
        ("download.retries=-1", "download.retries"),
        ("part_size=0", "part_size"),
        ("samples_per_shard=0", "samples_per_shard"),
        ("download_actors=-1", "download_actors"),
        ("filters.names=random:fraction=5", r"filters.names\[0\].fraction"),
        ("filters.names=random:fraction=0", r"filters.names\[0\].fraction"),
        ("filters.names=clip_score:fraction=1.5", r"filters.names\[0\].fraction"),
        ("dedupe.phash_threshold=65", "dedupe.phash_threshold"),
    ],
)
def test_build_config_ranges_fail_at_construction_naming_the_field(override, field):
    with pytest.raises(ConfigError, match="^" + field.replace(".", r"\.") + ": input should be"):
        resolve(BUILD_PRESETS, "demo", None, [override])


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("optim.lr=0", "optim.lr"),
        ("optim.betas=[0.9, 1.0]", "optim.betas"),
        ("global_batch_size=0", "global_batch_size"),
        ("model=ViT-Z", "model"),
        ("loss.name=triplet", "loss.name"),
        ("precision=fp8", "precision"),
    ],
)
def test_train_config_ranges_fail_at_construction(override, field):
    from training.config import TRAIN_PRESETS

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        resolve(TRAIN_PRESETS, "demo", None, [override])


def test_direct_construction_checks_types_and_ranges():
    from pipeline.config import DownloadConfig

    with pytest.raises(
        ConfigError, match=r"^DownloadConfig\.jpeg_quality: input should be greater than or equal"
    ):
        DownloadConfig(jpeg_quality=0)
    # a string is not silently parsed outside the CLI/YAML layers, in either plane
    with pytest.raises(
        ConfigError, match=r"^DownloadConfig\.timeout_s: input should be a valid number, got '10'"
    ):
        DownloadConfig(timeout_s="10")
    with pytest.raises(
        ConfigError, match=r"^DownloadConfig\.retries: input should be a valid integer, got '2'"
    ):
        DownloadConfig(retries="2")
    from training.config import DataConfig

    with pytest.raises(
        ConfigError, match=r"^DataConfig\.decode_tasks: input should be a valid integer, got '2'"
    ):
        DataConfig(decode_tasks="2")
    for bad in (0.5, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"DownloadConfig\.jpeg_dct_margin"):
            DownloadConfig(jpeg_dct_margin=bad)
    assert DownloadConfig(jpeg_dct_margin=0).jpeg_dct_margin == 0  # full decode: img2dataset's bytes
    assert DownloadConfig().jpeg_dct_margin == 3 and DownloadConfig(jpeg_dct_margin=1).jpeg_dct_margin == 1


def test_yaml_error_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("download:\n  timeout_s: -3\n")
    with pytest.raises(
        ConfigError, match=r"bad\.yaml: download\.timeout_s: input should be greater than 0, got -3"
    ):
        resolve(BUILD_PRESETS, "demo", str(path))


def test_fixed_length_tuples_seeds_and_exponent_ints():
    from training.config import TRAIN_PRESETS

    # Adam's betas, a crop's aspect range, a pixel mean: a wrong count used to pass and crash in the worker
    for key, value, words in (
        ("optim.betas", "[0.9]", None),
        ("optim.betas", "[0.9, 0.98, 0.5]", "tuple should have at most 2 items after validation, not 3"),
        ("data.mean", "[0.5, 0.5]", None),
    ):
        missing = f"{key}\\[{value.count(',') + 1}\\]: required"  # a value short: the first one missing
        with pytest.raises(ConfigError, match=f"{key}: {words}" if words else missing):
            resolve(TRAIN_PRESETS, "demo", sets=[f"{key}={value}"])
    # numpy's generators take no negative seed: a negative one used to fail after the build
    for key in ("seed", "data.mask_seed", "data.shuffle_seed", "data.augment_seed"):
        with pytest.raises(ConfigError, match=f"{key}: input should be greater than or equal to 0, got -1"):
            resolve(TRAIN_PRESETS, "demo", sets=[f"{key}=-1"])
    for key in ("demo_seed",):
        with pytest.raises(ConfigError, match=f"{key}: input should be greater than or equal to 0, got -2"):
            resolve(BUILD_PRESETS, "demo", sets=[f"{key}=-2"])
    with pytest.raises(
        ConfigError, match=r"filters\.names\[0\]\.seed: input should be greater than or equal to 0"
    ):
        resolve(BUILD_PRESETS, "demo", sets=["filters.names=random:seed=-2"])
    cfg = resolve(TRAIN_PRESETS, "demo", sets=["samples_seen=1e4", "optim.betas=[0.8, 0.9]"])
    assert cfg.samples_seen == 10_000 and cfg.optim.betas == (0.8, 0.9)  # "1e4" is a number, as in YAML 1.2
    with pytest.raises(
        ConfigError,
        match="samples_seen: input should be a valid integer, got a number with a fractional part",
    ):
        resolve(TRAIN_PRESETS, "demo", sets=["samples_seen=1.5"])


def test_flat_s3_endpoint_reads_as_the_storage_setting_at_every_depth(tmp_path):
    from pipeline.common.config import load, to_dict
    from training.config import TRAIN_PRESETS, TrainConfig

    flat = resolve(BUILD_PRESETS, "demo", sets=["s3_endpoint=http://127.0.0.1:8333"])
    new = resolve(BUILD_PRESETS, "demo", sets=["storage.s3_endpoint=http://127.0.0.1:8333"])
    assert flat == new and flat.storage.s3_endpoint == "http://127.0.0.1:8333"
    assert flat.storage.store().endpoint == "http://127.0.0.1:8333"
    assert "s3_endpoint" not in to_dict(flat) and to_dict(flat)["storage"] == {
        "s3_endpoint": "http://127.0.0.1:8333"
    }
    # a config file of the old form, nested (training's data and run hold one each)
    old = tmp_path / "old.yaml"
    old.write_text("data:\n  s3_endpoint: http://h:1\nrun:\n  s3_endpoint: http://h:2\n")
    cfg = resolve(TRAIN_PRESETS, "demo", config_file=str(old))
    assert (cfg.data.storage.s3_endpoint, cfg.run.storage.s3_endpoint) == ("http://h:1", "http://h:2")
    assert load(TrainConfig, {"data": {"s3_endpoint": "http://h:1"}}).data.storage.s3_endpoint == "http://h:1"
    with pytest.raises(ConfigError, match="s3_endpoint and storage.s3_endpoint are one setting"):
        merge(BuildConfig(), {"s3_endpoint": "http://a:1", "storage": {"s3_endpoint": "http://b:1"}})
    with pytest.raises(ConfigError, match="unknown config key storage.endpoint"):
        merge(BuildConfig(), {"storage": {"endpoint": "http://a:1"}})


def test_s3_endpoint_is_declared_once():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3]
    found = [
        str(p.relative_to(root))
        for folder in ("pipeline", "training", "jobs")
        for p in (root / folder).rglob("*.py")
        if re.search(r"^\s+s3_endpoint: ", p.read_text(), re.M)
    ]
    assert found == ["pipeline/common/storage_config.py"]
