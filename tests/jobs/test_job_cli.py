"""Every job reads its config the same way: --preset → --config → (flags) → --set, one clean line on error."""

from __future__ import annotations

import importlib

import pytest
import yaml

from pipeline.common.config import nested

JOBS = (
    "build_dataset", "train", "embed", "reshard", "demo_pool", "evaluate", "adapters", "filter", "track",
    "import_checkpoint", "status", "track.seeds", "fetch",
)  # fmt: skip


def _main(job):
    """A job's ``main``: ``jobs/<job>.py``, or ``jobs/<job>/cli.py`` for a job that is a package."""
    module = importlib.import_module(f"jobs.{job}")
    return (module if hasattr(module, "main") else importlib.import_module(f"jobs.{job}.cli")).main


def _run(main, argv):
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("job", JOBS)
def test_help_lists_preset_config_and_set(job, capsys):
    main = _main(job)
    assert _run(main, ["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--preset", "--config", "--set"):
        assert flag in out, (job, flag)


@pytest.mark.parametrize("job", JOBS)
def test_unknown_set_key_is_one_line_naming_it(job, capsys):
    main = _main(job)
    assert _run(main, ["--set", "no_such_key=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_such_key" in err[0] and "Traceback" not in err[0], err


@pytest.mark.parametrize("job", JOBS)
def test_bad_yaml_value_names_field_and_file(job, tmp_path, capsys):
    main = _main(job)
    path = tmp_path / "bad.yaml"
    path.write_text("no_such_key: 3\n")
    assert _run(main, ["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.yaml" in err[0] and "no_such_key" in err[0], err


@pytest.mark.parametrize("job", JOBS)
def test_unreadable_or_malformed_config_is_one_line_naming_the_file(job, tmp_path, capsys):
    main = _main(job)
    broken = tmp_path / "broken.yaml"
    broken.write_text("download:\n  retries: [1, 2\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00retries: 1\n")
    cases = (
        (["--config", str(tmp_path / "missing.yaml")], ("missing.yaml", "cannot read")),
        (["--config", str(tmp_path)], (str(tmp_path), "cannot read")),
        (["--config", str(broken)], ("broken.yaml", "not valid YAML", "line 3")),
        (["--config", str(binary)], ("binary.yaml",)),
        (["--set", "a.b=[1, 2"], ("--set a.b", "not valid YAML")),
    )
    for argv, words in cases:
        assert _run(main, argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), (argv, err)


# One flag per job and the config key it is shorthand for.
FLAG_KEYS = {
    "build_dataset": ("--output", "output"),
    "train": ("--shards", "data.shards"),
    "embed": ("--out", "out"),
    "reshard": ("--out", "out"),
    "demo_pool": ("--out", "out"),
    "evaluate": ("--out", "out"),
    "adapters": ("--out", "out"),
    "filter": ("--out", "out"),
    "track": ("--output", "output"),
    "import_checkpoint": ("--out", "out"),
    "status": ("--s3-endpoint", "storage.s3_endpoint"),
    "track.seeds": ("--out", "out"),
    "fetch": ("--out", "out"),
}


def _resolved(job, argv, capsys):
    assert _run(_main(job), [*argv, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def _get(tree, key):
    for part in key.split("."):
        tree = tree[part]
    return tree


@pytest.mark.parametrize("job", JOBS)
def test_preset_then_config_then_flags_then_set(job, tmp_path, capsys):
    """Each layer overrides the one before it: preset → --config → the job's flag → --set."""
    flag, key = FLAG_KEYS[job]
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(nested(key, "from-config")))
    preset = _resolved(job, [], capsys)
    assert _get(preset, key) != "from-config"
    assert _get(_resolved(job, ["--config", str(config)], capsys), key) == "from-config"
    assert _get(_resolved(job, ["--config", str(config), flag, "from-flag"], capsys), key) == "from-flag"
    final = _resolved(job, ["--config", str(config), flag, "from-flag", "--set", f"{key}=from-set"], capsys)
    assert _get(final, key) == "from-set"
    # the same order whatever the order on the command line
    swapped = _resolved(job, ["--set", f"{key}=from-set", flag, "from-flag", "--config", str(config)], capsys)
    assert swapped == final


@pytest.mark.parametrize("job", JOBS)
def test_print_config_round_trips_as_a_config_file(job, tmp_path, capsys):
    flag, key = FLAG_KEYS[job]
    first = _resolved(job, [flag, "somewhere", "--set", f"{key}=elsewhere"], capsys)
    saved = tmp_path / "resolved.yaml"
    saved.write_text(yaml.safe_dump(first))
    assert _resolved(job, ["--config", str(saved)], capsys) == first


def _parser_of(job, monkeypatch):
    """The argparse parser a job builds (captured from parse_job_config), and its preset's config."""
    import jobs.common as common

    seen = {}
    real = common._parser

    def capture(*args, **kwargs):
        seen["parser"] = real(*args, **kwargs)
        return seen["parser"]

    monkeypatch.setattr(common, "_parser", capture)
    _run(_main(job), ["--print-config"])
    return seen["parser"]


@pytest.mark.parametrize("job", JOBS)
def test_help_teaches_the_real_program_an_example_and_every_flag(job, monkeypatch, capsys):
    assert _run(_main(job), ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m jobs.{job} "), out[:80]
    assert "\nexample:\n  python -m jobs." in out and "``" not in out  # no raw reST markup
    assert "--help-config" in out and "3 input error" in out
    parser = _parser_of(job, monkeypatch)
    capsys.readouterr()
    for action in parser._actions:
        assert action.help and not action.help.startswith("sets "), (job, action.option_strings, action.help)


@pytest.mark.parametrize("job", JOBS)
def test_help_config_lists_every_key_with_type_value_and_meaning(job, capsys):
    from pipeline.common.config_help import KeyDoc, key_docs

    presets = _presets(job)
    for name, cfg in presets.items():
        assert _run(_main(job), ["--preset", name, "--help-config"]) == 0
        out = capsys.readouterr().out
        docs = [d for d in key_docs(cfg) if isinstance(d, KeyDoc)]
        assert docs and f"value of preset {name!r}" in out
        for doc in docs:
            assert f"  {doc.key} = " in out and f"({doc.type})" in out, (job, doc.key)
            assert doc.meaning, f"{job}: config key {doc.key} has no comment (its meaning in --help-config)"


def _presets(job):
    """The presets a job parses with, as parse_job_config sees them."""
    import jobs.common as common

    seen = {}
    real = common.resolve

    def capture(presets, *args, **kwargs):
        seen.update(presets)
        return real(presets, *args, **kwargs)

    common.resolve, original = capture, common.resolve
    try:
        _run(_main(job), ["--print-config"])
    finally:
        common.resolve = original
    return seen


def test_help_imports_neither_torch_nor_ray():
    """--help and --help-config answer before torch or Ray loads (bench/job_help.py times them)."""
    import subprocess
    import sys

    code = (
        "import importlib, sys\n"
        f"for job in {JOBS!r}:\n"
        "    m = importlib.import_module(f'jobs.{job}')\n"
        "    main = m.main if hasattr(m, 'main') else importlib.import_module(f'jobs.{job}.cli').main\n"
        "    for flag in ('--help', '--help-config'):\n"
        "        try:\n"
        "            main([flag])\n"
        "        except SystemExit:\n"
        "            pass\n"
        "print(sorted(m for m in ('torch', 'ray', 'pandas', 'matplotlib', 'scipy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]


@pytest.mark.parametrize(
    ("job", "preset", "keys"),
    [
        ("build_dataset", "datacomp-small", "output, metadata"),
        ("train", "datacomp-small", "data.shards, run.storage_path"),
        ("train", "prolip-b16", "data.shards, run.storage_path"),
        ("filter", "datacomp-small", "checkpoint, shards, out"),
        ("track", "datacomp-small", "output, build.metadata, eval_root"),
    ],
)
def test_real_data_presets_name_no_bucket_and_require_what_they_write(job, preset, keys, capsys):
    """A forgotten --output must stop the job, not send it to a placeholder bucket."""
    resolved = yaml.safe_dump(_resolved(job, ["--preset", preset], capsys))
    assert "s3://" not in resolved, resolved
    assert _run(_main(job), ["--preset", preset]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"config error: {keys} required (give "), err
