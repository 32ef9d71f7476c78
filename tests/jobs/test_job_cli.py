"""Every job reads its config the same way: --preset → --config → (flags) → --set, one clean line on error."""

from __future__ import annotations

import importlib

import pytest

JOBS = (
    "build_dataset", "train", "embed", "reshard", "demo_pool", "evaluate", "adapters", "filter", "track",
    "import_checkpoint",
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
