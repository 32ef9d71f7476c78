"""Every job reads its config the same way: --preset → --config → (flags) → --set, one clean line on error."""

from __future__ import annotations

import importlib

import pytest

JOBS = (
    "build_dataset", "train", "embed", "reshard", "demo_pool", "evaluate", "adapters", "filter", "track",
    "import_checkpoint",
)  # fmt: skip


def _run(main, argv):
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("job", JOBS)
def test_help_lists_preset_config_and_set(job, capsys):
    main = importlib.import_module(f"jobs.{job}").main
    assert _run(main, ["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--preset", "--config", "--set"):
        assert flag in out, (job, flag)


@pytest.mark.parametrize("job", JOBS)
def test_unknown_set_key_is_one_line_naming_it(job, capsys):
    main = importlib.import_module(f"jobs.{job}").main
    assert _run(main, ["--set", "no_such_key=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_such_key" in err[0] and "Traceback" not in err[0], err


@pytest.mark.parametrize("job", JOBS)
def test_bad_yaml_value_names_field_and_file(job, tmp_path, capsys):
    module = importlib.import_module(f"jobs.{job}")
    path = tmp_path / "bad.yaml"
    path.write_text("no_such_key: 3\n")
    assert _run(module.main, ["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.yaml" in err[0] and "no_such_key" in err[0], err
