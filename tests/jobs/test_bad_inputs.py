"""Every job × every kind of bad input: one line on stderr naming what and where, the documented exit
status (docs/jobs.md, "Errors and exit codes"), no traceback, and Ray never started for a check that
does not need it.

The kinds: a missing file, a file of the wrong kind (a text file where shards, metadata, a subset, a
checkpoint or weights belong), an S3 endpoint that does not answer (a port nobody listens on), an unknown
config key and a value out of range. Each job's ``main`` runs in this process with ``ray.init`` replaced
by a recorder, so "Ray was not started" is checked, not timed; the time to each error is printed
(``pytest -s``) and measured for cold processes, with the S3 client's default retries, by bench/job_cli.py.
"""

from __future__ import annotations

import importlib
import socket
import time

import numpy as np
import pytest

from tests.fixtures.train_shards import write_demo_shards

CONFIG, INPUT, STORAGE, REFUSED = 2, 3, 4, 5
KINDS = ("missing", "wrong_kind", "unreachable_s3", "bad_key", "out_of_range")
TIMES: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Real inputs beside the bad ones: one shard, one subset .npy; a text file; a missing path; an S3
    endpoint on a port held bound but not listening, so a connection is refused and no other process
    can take the port meanwhile."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    yield bad_input_files(tmp_path_factory.mktemp("bad_inputs"), f"http://127.0.0.1:{held.getsockname()[1]}")
    held.close()


def bad_input_files(root, dead: str) -> dict:
    shard = write_demo_shards(root / "shards", n_shards=1, per_shard=2, size=16)[0]
    subset = root / "subset.npy"
    np.save(subset, np.zeros(1, dtype=np.dtype("u8,u8")))
    text = root / "notes.txt"
    text.write_text("these are notes, not data\n")
    return {
        "root": root,
        "shard": shard,
        "subset": str(subset),
        "text": str(text),
        "missing": str(root / "no-such-input"),
        "dead": dead,
    }


def cases(f: dict) -> dict[tuple[str, str], tuple[list[str], int, tuple[str, ...]]]:
    """(job, kind) → (argv, exit status, words the one line must hold)."""
    out, s3, dead, text, missing = str(f["root"] / "out"), "s3://bucket/x", f["dead"], f["text"], f["missing"]
    ckpt = ["--shards", f["shard"], "--out", out]
    return {
        ("build_dataset", "missing"): (["--metadata", missing, "--output", out], INPUT, ("metadata", missing, "not found")),
        ("build_dataset", "wrong_kind"): (["--metadata", text, "--output", out], INPUT, (text, "not a parquet file", "text file")),
        ("build_dataset", "unreachable_s3"): (["--metadata", s3, "--s3-endpoint", dead, "--output", out], STORAGE, ("metadata", s3, "NETWORK_CONNECTION")),
        ("build_dataset", "bad_key"): (["--set", "part_sise=5"], CONFIG, ("unknown config key part_sise",)),
        ("build_dataset", "out_of_range"): (["--set", "part_size=0"], CONFIG, ("part_size", "greater than 0")),
        ("train", "missing"): (["--shards", missing], INPUT, ("data.shards", missing, "not found")),
        ("train", "wrong_kind"): (["--shards", text], INPUT, (text, "not a tar file", "text file")),
        ("train", "unreachable_s3"): (["--shards", s3, "--set", f"data.s3_endpoint={dead}"], STORAGE, ("data.shards", s3, "NETWORK_CONNECTION")),
        ("train", "bad_key"): (["--set", "optim.learning_rate=1"], CONFIG, ("unknown config key optim.learning_rate", "known: lr")),
        ("train", "out_of_range"): (["--set", "optim.lr=-1"], CONFIG, ("optim.lr", "greater than 0", "-1")),
        ("embed", "missing"): (["--checkpoint", missing, *ckpt[:2], "--out", out + ".parquet"], INPUT, ("checkpoint", missing, "not found")),
        ("embed", "wrong_kind"): (["--checkpoint", text, *ckpt[:2], "--out", out + ".parquet"], INPUT, ("checkpoint", text, "a file, not a directory")),
        ("embed", "unreachable_s3"): (["--checkpoint", s3, "--shards", s3, "--s3-endpoint", dead, "--out", out], STORAGE, ("checkpoint", s3, "NETWORK_CONNECTION")),
        ("embed", "bad_key"): (["--set", "num_actor=2"], CONFIG, ("unknown config key num_actor",)),
        ("embed", "out_of_range"): (["--set", "num_actors=0"], CONFIG, ("num_actors", "greater than 0")),
        ("reshard", "missing"): (["--shards", missing, "--subset", f["subset"], "--out", out], INPUT, ("shards", missing, "not found")),
        ("reshard", "wrong_kind"): (["--shards", f["shard"], "--subset", text, "--out", out], INPUT, (text, "not a npy file", "text file")),
        ("reshard", "unreachable_s3"): (["--shards", s3, "--subset", f["subset"], "--out", out, "--s3-endpoint", dead], STORAGE, ("shards", s3, "NETWORK_CONNECTION")),
        ("reshard", "bad_key"): (["--set", "sample_per_shard=5"], CONFIG, ("unknown config key sample_per_shard",)),
        ("reshard", "out_of_range"): (["--set", "samples_per_shard=0"], CONFIG, ("samples_per_shard", "greater than 0")),
        ("evaluate", "missing"): (["--checkpoint", missing, "--out", out], INPUT, ("checkpoint", missing, "not found")),
        ("evaluate", "wrong_kind"): (["--checkpoint", text, "--out", out], INPUT, ("checkpoint", text, "a file, not a directory")),
        ("evaluate", "unreachable_s3"): (["--checkpoint", s3, "--s3-endpoint", dead, "--out", out], STORAGE, ("checkpoint", s3, "NETWORK_CONNECTION")),
        ("evaluate", "bad_key"): (["--set", "analysis=false"], CONFIG, ("unknown config key analysis", "known:")),
        ("evaluate", "out_of_range"): (["--set", "batch_size=-3"], CONFIG, ("batch_size", "greater than 0")),
        ("adapters", "missing"): (["--train", missing, "--eval", missing, "--out", out], INPUT, ("train", missing, "not found")),
        ("adapters", "wrong_kind"): (["--train", text, "--eval", text, "--out", out], INPUT, (text, "not a parquet file")),
        ("adapters", "unreachable_s3"): (["--train", s3, "--eval", s3, "--out", out, "--s3-endpoint", dead], STORAGE, ("train", s3, "NETWORK_CONNECTION")),
        ("adapters", "bad_key"): (["--set", "probvlm_epoch=3"], CONFIG, ("unknown config key probvlm_epoch",)),
        ("adapters", "out_of_range"): (["--set", "probvlm_epochs=0"], CONFIG, ("probvlm_epochs", "greater than 0")),
        ("import_checkpoint", "missing"): (["--source", f"openclip:ViT-B-32:{missing}", "--out", out], INPUT, ("source", missing, "not found")),
        ("import_checkpoint", "wrong_kind"): (["--source", f"prolip:{text}", "--out", out], INPUT, (text, "not a weights file")),
        ("import_checkpoint", "unreachable_s3"): (["--source", "prolip:hf-hub:org/model", "--out", s3, "--s3-endpoint", dead], STORAGE, ("out", s3, "NETWORK_CONNECTION")),
        ("import_checkpoint", "bad_key"): (["--set", "tokeniser=clip"], CONFIG, ("unknown config key tokeniser",)),
        ("import_checkpoint", "out_of_range"): (["--set", "tokenizer_clean=upper"], CONFIG, ("tokenizer_clean", "'upper'")),
        # The demo pool reads no input: its one file is the --config, and it writes only to local disk.
        ("demo_pool", "missing"): (["--out", out, "--config", missing], CONFIG, (missing, "cannot read the config file")),
        ("demo_pool", "wrong_kind"): (["--out", text], INPUT, (text, "a file, not a directory")),
        ("demo_pool", "unreachable_s3"): (["--out", s3], CONFIG, ("out", "local directory", s3)),
        ("demo_pool", "bad_key"): (["--set", "rows=5"], CONFIG, ("unknown config key rows",)),
        ("demo_pool", "out_of_range"): (["--out", out, "--set", "port=70000"], CONFIG, ("port", "less than or equal to 65535")),
        ("filter", "missing"): (["--checkpoint", missing, *ckpt], INPUT, ("checkpoint", missing, "not found")),
        ("filter", "wrong_kind"): (["--checkpoint", missing, "--shards", text, "--out", out], INPUT, (text, "not a tar file")),
        ("filter", "unreachable_s3"): (["--checkpoint", missing, "--shards", s3, "--out", out, "--s3-endpoint", dead], STORAGE, ("shards", s3, "NETWORK_CONNECTION")),
        ("filter", "bad_key"): (["--set", "filter=[csd_best]"], CONFIG, ("unknown config key filter", "known:")),
        ("filter", "out_of_range"): (["--set", "filters=[csd_best:fraction=2]", *ckpt, "--checkpoint", missing], CONFIG, ("filters", "fraction")),
        ("track", "missing"): (["--output", out, "--set", f"build.metadata={missing}"], INPUT, ("build.metadata", missing, "not found")),
        ("track", "wrong_kind"): (["--output", text], INPUT, ("output", text, "a file, not a directory")),
        ("track", "unreachable_s3"): (["--set", f"output={s3}", "--set", f"s3_endpoint={dead}", "--set", "scorer.tokenizer=clip", "--set", "train.tokenizer=clip", "--set", "unofficial=true"], STORAGE, ("output", s3, "NETWORK_CONNECTION")),
        ("track", "bad_key"): (["--set", "scorer.optim.lrr=1"], CONFIG, ("unknown config key scorer.optim.lrr",)),
        ("track", "out_of_range"): (["--set", "csd_fraction=0"], CONFIG, ("csd_fraction", "greater than 0")),
        ("status", "missing"): ([missing], INPUT, (missing, "not found")),
        ("status", "wrong_kind"): ([text], INPUT, (text, "not a build, training or track run")),
        ("status", "unreachable_s3"): ([s3, "--s3-endpoint", dead], STORAGE, (s3, "NETWORK_CONNECTION")),
        ("status", "bad_key"): ([out, "--set", "runs=x"], CONFIG, ("unknown config key runs", "known: run")),
        ("status", "out_of_range"): ([out, "--preset", "full"], CONFIG, ("invalid choice: 'full'", "--help")),
        ("track.seeds", "missing"): ([missing], INPUT, (missing, "track_results.json: not found")),
        ("track.seeds", "wrong_kind"): ([text], INPUT, (text, "not found", "a finished track run")),
        ("track.seeds", "unreachable_s3"): ([s3, "--s3-endpoint", dead], STORAGE, (s3, "NETWORK_CONNECTION")),
        ("track.seeds", "bad_key"): ([out, "--set", "run=x"], CONFIG, ("unknown config key run", "known: runs")),
        ("track.seeds", "out_of_range"): ([out, out], CONFIG, ("given more than once",)),
    }  # fmt: skip


JOBS = ("build_dataset", "train", "embed", "reshard", "evaluate", "adapters", "import_checkpoint",
        "demo_pool", "filter", "track", "status", "track.seeds")  # fmt: skip


def _main(job: str):
    module = importlib.import_module(f"jobs.{job}")
    return (module if hasattr(module, "main") else importlib.import_module(f"jobs.{job}.cli")).main


def test_every_job_and_kind_has_a_case(files):
    assert set(cases(files)) == {(job, kind) for job in JOBS for kind in KINDS}


def _check(rc: int, err: str, code: int, words: tuple[str, ...]) -> None:
    lines = err.strip().splitlines()
    assert rc == code and len(lines) == 1, (rc, err)
    assert "Traceback" not in err and all(w in lines[0] for w in words), (words, lines[0])
    kind_word = {CONFIG: "config error: ", INPUT: "input error: ", STORAGE: "storage error: "}[code]
    assert lines[0].startswith(kind_word), lines[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("job", JOBS)
def test_bad_input_is_one_line_with_its_exit_status(job, kind, files, monkeypatch, capsys):
    import ray

    # One attempt, not the S3 client's three with jittered waits (~1 s a case; bench/job_cli.py times those).
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    started = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(a) or pytest.fail("Ray started"))
    argv, code, words = cases(files)[(job, kind)]
    main = _main(job)
    t0 = time.perf_counter()
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own exits (--help) only; errors come back as a status
        rc = exc.code
    TIMES[(job, kind)] = time.perf_counter() - t0
    err = capsys.readouterr().err
    print(f"{job} {kind}: exit {rc} after {TIMES[(job, kind)]:.2f} s")
    _check(rc, err, code, words)
    assert not started and not (files["root"] / "out").exists(), "Ray started, or an error left an output"


def test_a_bug_prints_its_traceback_and_says_so(monkeypatch, capsys):
    """Anything that is not an anticipated failure is a bug: the traceback, then one line saying so."""
    from jobs import status

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(status, "status_lines", broken)
    assert status.main(["somewhere"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'a bug'" in err
    assert err.strip().splitlines()[-1].startswith("internal error: KeyError is a bug in prolip-ray")
