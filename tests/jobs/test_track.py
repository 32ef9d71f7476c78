"""The filtering track: config validation, the report's arithmetic, and the tiny preset end to end."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from jobs.track.config import TRACK_PRESETS, TrackConfig
from jobs.track.report import markdown_table
from jobs.track.results import comparison_table, verdict
from pipeline.common.config import ConfigError, merge, resolve
from pipeline.filters.registry import CsdUncertaintyAware


def test_unknown_subset_is_named():
    with pytest.raises(ConfigError, match="subsets"):
        merge(TrackConfig(), {"subsets": ["no_filter", "csd_magic"]})


def test_a_repeated_seed_or_subset_is_named():
    # it would train one model twice and count it twice in the report's "n/n seeds better"
    with pytest.raises(ConfigError, match=r"seeds: repeated \[1\]"):
        merge(TrackConfig(), {"seeds": [0, 1, 2, 1]})
    with pytest.raises(ConfigError, match=r"subsets: repeated \['csd'\]"):
        merge(TrackConfig(), {"subsets": ["no_filter", "csd", "random", "csd"]})
    assert merge(TrackConfig(), {"seeds": [2, 0, 1]}).seeds == (2, 0, 1)
    with pytest.raises(ConfigError, match=r"seeds\[\d\]: input should be greater than or equal to 0, got -1"):
        merge(TrackConfig(), {"seeds": [0, -1]})


def test_the_task_list_is_checked_before_the_build(tmp_path):
    # it is read only after every training, so a typo used to cost the whole run
    with pytest.raises(ConfigError, match=r"eval_tasks: task list not found: demo2 \(known names: "):
        merge(TrackConfig(), {"eval_tasks": "demo2"})
    broken = tmp_path / "tasks.yaml"
    broken.write_text("tasks: [\n")
    with pytest.raises(ConfigError, match="eval_tasks: .*tasks.yaml: not valid YAML"):
        merge(TrackConfig(), {"eval_tasks": str(broken)})


def test_random_control_needs_its_reference():
    with pytest.raises(ConfigError, match="random_of"):
        merge(TrackConfig(), {"subsets": ["no_filter", "random"], "random_of": "csd"})


def test_uncertainty_tails_must_leave_captions_between_them():
    for low, high in ((0.9, 0.9), (0.5, 0.4)):
        spec = f"csd_uncertainty_aware:text_unc_quantile={high},text_unc_low_quantile={low},label=csd_uncertainty"
        with pytest.raises(ConfigError, match=r"filters\[0\]: .*text_unc_low_quantile"):
            merge(TrackConfig(), {"filters": spec})
    with pytest.raises(ConfigError, match="text_unc_low_quantile"):
        merge(TrackConfig(), {"filters": "csd_uncertainty_aware:text_unc_low_quantile=-0.1,label=x"})


def test_a_variant_replaces_its_built_in_subset_at_the_shared_size():
    from jobs.track.steps import subset_specs
    from pipeline.filters.specs import parse_filter_specs

    spec = "csd_uncertainty_aware:text_unc_quantile=1,text_unc_low_quantile=0.1,label=csd_uncertainty"
    cfg = merge(TrackConfig(), {"csd_fraction": 0.4, "filters": spec})  # the text a --set line gives
    specs = parse_filter_specs(subset_specs(cfg), "subsets", known=["no_filter", "basic"])
    assert [s.label for s in specs].count("csd_uncertainty") == 1
    (variant,) = [s for s in specs if s.label == "csd_uncertainty"]
    assert variant.filters == [
        CsdUncertaintyAware(fraction=0.4, text_unc_quantile=1.0, text_unc_low_quantile=0.1)
    ]
    given = merge(cfg, {"filters": spec + ",fraction=0.2"})  # a fraction it gives wins
    assert [
        s.params["fraction"] for s in parse_filter_specs(subset_specs(given)) if s.label == "csd_uncertainty"
    ] == [0.2]


def test_the_removed_knobs_name_their_filter_spelling():
    for key, value, spelling in (
        ("text_unc_quantile", 1.0, "filters=csd_uncertainty_aware:text_unc_quantile="),
        ("text_unc_low_quantile", 0.1, "filters=csd_uncertainty_aware:text_unc_low_quantile="),
        ("ucb_k", 2.0, "filters=csd_ucb:k="),
        ("inclusion_quantile", 0.2, "filters=csd_inclusion:inclusion_quantile="),
    ):
        with pytest.raises(ConfigError, match=f"{key} is no longer a key; set {spelling}"):
            merge(TrackConfig(), {key: value})


def test_csd_needs_a_prolip_scorer():
    with pytest.raises(ConfigError, match="scorer.loss.name"):
        merge(TrackConfig(), {"scorer": {"loss": {"name": "clip"}}})


def test_presets_resolve_with_nested_overrides():
    cfg = resolve(
        TRACK_PRESETS,
        "demo",
        None,
        ["build.demo_n=500", "train.samples_seen=1280", "seeds=[0, 1]", "unofficial=true"],
    )
    assert cfg.build.demo_n == 500 and cfg.train.samples_seen == 1280 and cfg.seeds == (0, 1)
    for name in TRACK_PRESETS:
        assert dataclasses.replace(TRACK_PRESETS[name]) == TRACK_PRESETS[name]  # re-validates on construction
    with pytest.raises(ConfigError, match="train.samples_sen"):
        resolve(TRACK_PRESETS, "demo", None, ["train.samples_sen=5"])


def _evals(averages: dict[str, list[float]]) -> dict:
    out = {}
    for subset, values in averages.items():
        for seed, v in enumerate(values):
            out[f"{subset}-seed{seed}"] = {
                "results": [  # result lines in DataComp's schema, as training/eval/results.py writes them
                    {
                        "key": "shapes",
                        "dataset": "shapes",
                        "task": "shapes",
                        "metrics": {"main_metric": v + 0.1},
                    },
                    {
                        "key": "colours",
                        "dataset": "colours",
                        "task": "colours",
                        "metrics": {"main_metric": v - 0.1},
                    },
                ],
                "aggregates": {"average": v},
            }
    return out


def test_verdict_and_table_are_computed_per_seed():
    cfg = SimpleNamespace(subsets=("no_filter", "csd", "random"), seeds=(0, 1))
    evals = _evals({"no_filter": [0.30, 0.40], "csd": [0.35, 0.38], "random": [0.20, 0.25]})
    v = verdict(cfg, evals)
    assert v["csd_vs_no_filter"]["diff_by_seed"] == pytest.approx([0.05, -0.02])
    assert v["csd_vs_no_filter"]["mean_diff"] == pytest.approx(0.015)
    assert v["csd_vs_no_filter"]["beats"] is False and v["csd_vs_no_filter"]["wins"] == 1
    assert v["csd_vs_random"]["beats"] is True and v["csd_vs_random"]["mean_diff"] == pytest.approx(0.14)
    subsets = {
        s: {"size": n, "downloaded": n - 10} for s, n in (("no_filter", 100), ("csd", 50), ("random", 50))
    }
    models = {k: {"samples_seen": 1000} for k in evals}
    rows = comparison_table(cfg, subsets, models, evals)
    csd = next(r for r in rows if r["subset"] == "csd")
    assert csd["average"] == pytest.approx(0.365) and csd["tasks"]["shapes"] == pytest.approx(0.465)
    assert csd["average_sd"] == pytest.approx(0.0212132, abs=1e-6)
    text = markdown_table(rows)
    assert "| csd | 50 | 40 | 1000 | 0.265 | 0.465 | 0.365 ± 0.021 |" in text


@pytest.mark.ray
@pytest.mark.slow
def test_tiny_track_end_to_end_and_resume(tiny_track, tmp_path, capsys):
    from jobs.status import status_lines
    from jobs.track.cli import main
    from pipeline.common.storage import LOCAL
    from tests.jobs.test_track_report import _Refs

    # Run once per session (tests/fixtures/tiny_track.py), also the cluster's reference.
    out, args, half = tiny_track.out, tiny_track.args, tiny_track.half
    # Killed once its build is recorded: jobs.status says what is done and what is not ...
    assert half[0] == "track: 1 of 13 steps finished" and "  done  build" in half[1], half
    assert (
        "  to do scorer" in half
        and "  to do evaluate/random-seed0" in half
        and half[-1] == "report: not written yet"
    )
    # ... and the same command resumes from there.
    assert tiny_track.code == 0
    printed = tiny_track.printed
    report = (out / "report.md").read_text()
    results = json.loads((out / "track_results.json").read_text())
    subsets = [r["subset"] for r in results["table"]]
    assert subsets == ["no_filter", "csd", "clip_score_l14", "random"]
    sizes = {r["subset"]: r["size"] for r in results["table"]}
    assert sizes["csd"] == sizes["random"] < sizes["no_filter"]
    # no_filter lists the whole pool (DataComp's scope); only the downloaded part of it trains.
    trained = {r["subset"]: r["downloaded"] for r in results["table"]}
    assert trained["no_filter"] < sizes["no_filter"] and trained["csd"] == sizes["csd"]
    assert "| no_filter | " + str(sizes["no_filter"]) + " | " + str(trained["no_filter"]) + " |" in report
    for row in results["table"]:
        assert 0.0 <= row["average"] <= 1.0 and row["tasks"]
    assert set(results["verdict"]) == {"csd_vs_no_filter", "csd_vs_random", "csd_vs_clip_score_l14"}
    assert "| subset | size | downloaded | samples seen |" in report and "CSD filter vs controls" in report
    # The build's subsets that train no model here still show what they keep: basic drops non-English.
    purity = results["purity"]
    assert "| basic (not trained) | " in report and "basic" not in subsets
    assert purity["basic (not trained)"].get("non_english", 0.0) < purity["no_filter"]["non_english"]
    # The build looked for the pool's planted semantic duplicates and eval leaks (jobs/track/curation_report.py).
    truth = results["curation"]["build"]["truth"]
    assert truth["semantic_recall"] >= 0.95 and truth["semantic_precision"] >= 0.95, truth
    assert truth["leak_recall"] >= 0.95 and truth["false_leaks"] == 0, truth
    assert "## Curation in the build" in report and "Meets the bar" in report
    assert results["machine"]["cores"] >= 1 and results["machine"]["matmul_gflops"] > 0
    assert "Machine: " in report
    # The scorer's figures come with their intervals over resampled pictures, as the eval wrote them.
    analyses = json.loads((out / "eval" / "scorer" / "analyses.json").read_text())
    low, high = analyses["hierarchy_order"]["ordered_fraction_ci95"]
    assert "[eval/scorer/analyses.json](eval/scorer/analyses.json)" in report  # every figure, in its JSON
    # ... and the paper's claims lead the section, each figure with its interval.
    fraction = analyses["hierarchy_order"]["ordered_fraction"]
    claim = f"| adjacent hierarchy levels ordered | {fraction:.4f} | [{low:.4f}, {high:.4f}] | 0.90 (HierarCaps) |"
    assert claim in report
    assert printed.rstrip().splitlines()[-1].startswith("| random |")  # the table ends the output
    assert "[track] build: done earlier, skipped" in printed
    assert "[eval] task 1/4 colours: acc1 " in printed and "[eval] 4 task(s) → " in printed
    # report.html: the same report in one file, every figure inline
    refs = _Refs()
    refs.feed((out / "report.html").read_text())
    assert len(refs.refs) == report.count("![") >= 9
    assert all(tag == "img" and value.startswith("data:image/png;base64,") for tag, _, value in refs.refs)
    done = status_lines(str(out), LOCAL)
    assert done[0] == "track: 13 of 13 steps finished" and done[-1] == f"report: {out}/report.md", done
    for name in ("scorer", "no_filter-seed0", "csd-seed0", "clip_score_l14-seed0", "random-seed0"):
        assert (out / "eval" / name / "eval_results.jsonl").is_file()
    state = json.loads((out / "track_state.json").read_text())
    # The tiny preset trains its three subset models two at a time (train_parallel): each one recorded.
    models = {f"train/{s}-seed0" for s in subsets}
    assert {"build", "scorer", "score", "filters", "evaluate/scorer", *models} <= set(state)
    # The subset models read the build's shards through their subset's .npy: nothing was resharded.
    assert "reshard" not in state and not (out / "subset_shards").exists()
    assert models <= set(state["timings"]) and "2 at a time (train_parallel): their times overlap" in report
    # A re-run resumes: every recorded step is skipped, only the report is written again. Keys that say
    # where or how fast a step runs may change between the runs.
    assert (
        main(
            [*args, "--set", "scorer.run.log_every=3", "--set", "score_actors=2", "--set", "train_parallel=1"]
        )
        == 0
    )
    steps = [k for k in state if k not in ("timings", "config", "plan")]
    assert capsys.readouterr().out.count("done earlier, skipped") == len(steps)
    # A config that would change a finished step's output stops before Ray starts, naming the key ...
    samples = state["config"]["scorer"]["samples_seen"]
    assert main([*args, "--set", f"scorer.samples_seen={samples + 64}"]) == 5  # refused (docs/jobs.md)
    err = capsys.readouterr().err
    assert f"scorer.samples_seen: {samples} → {samples + 64}" in err and "new output" in err
    assert main([*args, "--set", "seeds=[5]"]) == 5  # the scorer's seed
    assert "scorer_seed: 0 → 5" in capsys.readouterr().err
    assert json.loads((out / "track_state.json").read_text()) == state  # and records nothing
    # ... and so does a run whose state has no recorded config (made by an earlier version).
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "track_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "config"}))
    assert main(["--preset", "tiny", "--set", f"output={legacy}"]) == 5
    assert "not their config" in capsys.readouterr().err
    # The seed table reads the same files: the run's figures with their intervals, and its summary.
    from jobs.track import seeds

    again = tmp_path / "again"  # a second run with the same figures: the table reads only these two files
    again.mkdir()
    for name in ("track_results.json", "track_state.json"):
        (again / name).write_bytes((out / name).read_bytes())
    assert seeds.main([str(out), str(again), "--out", str(tmp_path / "seeds.md")]) == 0
    table = (tmp_path / "seeds.md").read_text()
    cell = f"{fraction:.3f} [{low:.3f}, {high:.3f}]"
    assert f"| adjacent hierarchy levels ordered | {cell} | {cell} | {fraction:.3f} ± 0.000 |" in table
    summary = json.loads((tmp_path / "seeds.json").read_text())["summary"]
    diff = results["verdict"]["csd_vs_random"]["mean_diff"]
    assert summary["csd − random (average)"]["mean"] == pytest.approx(diff)
    assert summary["csd − random (average)"]["holds"] == (2 if diff > 0 else 0)
    assert seeds.main([str(out), str(out) + "/"]) == 2
    assert "given more than once" in capsys.readouterr().err
    assert seeds.main([str(out), str(tmp_path / "not-a-run")]) == 3
    assert "not-a-run/track_results.json: not found" in capsys.readouterr().err


def test_auroc_matches_hand_counts():
    from jobs.track.results import _auroc

    # positives 0.9, 0.4; negatives 0.5, 0.1, 0.4 → pairs won: 0.9 beats 3, 0.4 beats 1 and ties 1 → 4.5/6
    assert _auroc([0.9, 0.4, 0.5, 0.1, 0.4], [True, True, False, False, False]) == pytest.approx(4.5 / 6)


def test_noise_detection_groups_uninformative_and_non_english_captions(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.track.results import noise_detection
    from pipeline.common.storage import LOCAL

    (tmp_path / "pool").mkdir()
    noise = ["clean", "clean", "clean", "non_english", "mismatched", "clean"]
    truth = {"uid": list("abcdef"), "caption_noise": noise, "level": [0, 2, 3, 1, 2, 0]}
    pq.write_table(pa.table(truth), tmp_path / "pool" / "truth.parquet")
    scores = {
        "uid": list("abcdefg"),  # g: not in the pool's truth; f: failed to score
        "ok": [True, True, True, True, True, False, True],
        "csd": [1.0, 0.5, 0.4, 1.5, 2.0, 0.0, 0.1],
        "cosine": [0.1, 0.5, 0.6, 0.0, -0.1, 0.0, 0.9],
        "text_unc": [0.9, 0.2, 0.1, 0.5, 0.3, 0.0, 0.0],
    }
    pq.write_table(pa.table(scores), tmp_path / "scores.parquet")
    cfg = SimpleNamespace(output=str(tmp_path), build=SimpleNamespace(metadata=""))
    out = noise_detection(cfg, str(tmp_path / "scores.parquet"), LOCAL)
    assert out["text_unc_auroc_uninformative"] == 1.0  # a (0.9) above b, c, d, e
    assert out["text_unc_auroc_non_english"] == 0.75  # d (0.5) beats b, c, e; loses to a
    assert out["text_unc_mean_uninformative"] == pytest.approx(0.9)
    assert out["text_unc_mean_clean_specific"] == pytest.approx(0.15)
    assert out["text_unc_mean_non_english"] == pytest.approx(0.5)
    assert out["csd_auroc_mismatched"] == 1.0


def test_subset_purity_reads_subsets_from_s3(s3_server):
    """The report's purity table opens each subset .npy through the run's store: a run directory on S3
    (the track submitted to a cluster) has no local path to open."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.track.results import subset_purity
    from pipeline.common.storage import Storage
    from pipeline.subsets.uid_files import write_subset

    store = Storage(
        endpoint=s3_server.endpoint, access_key=s3_server.access_key, secret_key=s3_server.secret_key
    )
    out = s3_server.url("purity")
    uids = [f"{i:032x}" for i in range(4)]
    buf = io.BytesIO()
    pq.write_table(pa.table({"uid": uids, "caption_noise": ["", "mismatched", "", "non_english"]}), buf)
    store.write_bytes(buf.getvalue(), f"{out}/pool/truth.parquet")
    npy = io.BytesIO()
    write_subset(uids[:2], npy)
    store.write_bytes(npy.getvalue(), f"{out}/subsets/two.npy")
    cfg = SimpleNamespace(output=out, build=SimpleNamespace(metadata=""))
    got = subset_purity(cfg, {"two": {"path": f"{out}/subsets/two.npy"}}, store)
    assert got == {"two": {"clean": 0.5, "mismatched": 0.5}}


def test_baseline_subsets_must_be_built():
    with pytest.raises(ConfigError, match=r"build.filters.names: add \['basic'\]"):
        merge(TrackConfig(), {"build": {"filters": {"names": ["no_filter"]}}})


def test_track_subsets_are_filter_specs_with_the_library_random_control():
    from jobs.track.steps import subset_specs
    from pipeline.filters.specs import parse_filter_specs

    subsets = ["no_filter", "basic", "csd", "csd_uncertainty", "scorer_cosine", "random"]
    cfg = merge(TrackConfig(), {"subsets": subsets, "random_of": "basic", "seeds": [3]})
    specs = parse_filter_specs(subset_specs(cfg), "subsets", known=["no_filter", "basic"])
    assert [(s.label, s.name) for s in specs] == [
        ("csd", "csd_best"),
        ("csd_uncertainty", "csd_uncertainty_aware"),
        ("scorer_cosine", "clip_score_best"),
        ("random", "random_same_size"),
    ]
    assert specs[0].params == {"fraction": 0.5}
    assert specs[1].filters == [CsdUncertaintyAware(fraction=0.5)]  # the class's own defaults
    assert specs[-1].of == "basic" and specs[-1].params == {"seed": 3}


def test_claims_table_skips_a_scorer_without_sigma2():
    from jobs.track.report import _claim_lines
    from training.eval.uncertainty.measures import NOT_APPLICABLE

    assert _claim_lines({"sigma2_modality": NOT_APPLICABLE, "hierarchy_order": NOT_APPLICABLE}) == []
    only = _claim_lines({"hierarchy_order": {"ordered_fraction": 0.5, "ordered_fraction_ci95": [0.4, 0.6]}})
    assert only[-1] == "| adjacent hierarchy levels ordered | 0.5000 | [0.4000, 0.6000] | 0.90 (HierarCaps) |"


def test_seed_table_summarises_over_runs_and_shows_what_a_run_lacks():
    from jobs.track.seeds import markdown, run_figures, summarise

    def run(seed, csd, no_filter, spearman, ordered):
        results = {
            "table": [
                {"subset": "csd", "average": csd, "tasks": {"shapes": 0.3}},
                {"subset": "no_filter", "average": no_filter, "tasks": {}},
            ],
            "verdict": {"csd_vs_no_filter": {"mean_diff": csd - no_filter}},
            "noise_detection": {"csd_auroc_mismatched": 0.9},
        }
        analyses = {
            "sigma2_modality": {"text_gt_image": spearman < 0},
            "sigma2_length": {"spearman_words_vs_trace": spearman, "ci95": [spearman - 0.1, spearman + 0.1]},
            "hierarchy_order": {
                "ordered_fraction": ordered,
                "ordered_fraction_per_pair": [1.0, 0.5, ordered],
            },
        }
        return run_figures(results, {"scorer": {"seed": seed}, "evaluate/scorer": {"analyses": analyses}})

    runs = {
        "a": run(0, 0.40, 0.30, -0.5, 0.70),
        "b": run(1, 0.30, 0.35, 0.2, 0.90),
        "c": run(2, 0.5, 0.3, -0.3, 0.8),
    }
    summary = summarise(runs)
    diff = summary["csd − no_filter (average)"]
    assert diff["mean"] == pytest.approx((0.10 - 0.05 + 0.20) / 3) and diff["holds"] == 2 and diff["n"] == 3
    assert diff["sd"] == pytest.approx(0.1258306, abs=1e-6) and diff["min"] == pytest.approx(-0.05)
    assert summary["Spearman(caption words, tr Σ_t)"]["holds"] == 2  # negative on two runs of three
    assert summary["text Σσ² > image Σσ²"]["holds"] == 2 and "mean" not in summary["text Σσ² > image Σσ²"]
    assert summary["csd − random (average)"] == {"n": 0}  # no run has the random control
    text = markdown(runs, summary)
    assert "| csd − random (average) | – | – | – | – | – | – |" in text
    assert "| Spearman(caption words, tr Σ_t) | -0.500 [-0.600, -0.400] | 0.200 [0.100, 0.300] |" in text
    assert "| levels ordered per pair, % (0>1/1>2/2>3) | 100.0/50.0/70.0 |" in text
    # A scorer without σ² (CLIP) has no analyses: its claims are missing, not an error.
    clip = run_figures(
        {"table": []}, {"scorer": {"seed": 0}, "evaluate/scorer": {"analyses": "not applicable"}}
    )
    assert clip["figures"]["adjacent hierarchy levels ordered"] is None and clip["per_pair"] is None


def test_in_parallel_keeps_order_lets_the_others_finish_and_raises_the_first_failure():
    import threading
    import time

    from jobs.track.run import in_parallel

    running, peak, lock, lines = [0], [0], threading.Lock(), []

    def work(x):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05 * (3 - x % 3))  # later items finish first
        with lock:
            running[0] -= 1
        if x in (1, 3):
            raise ValueError(f"item {x}")
        return x * 10

    assert in_parallel(lambda x: x * 10, [0, 2, 4, 5], 2, lines.append) == [0, 20, 40, 50]
    done = []
    with pytest.raises(ValueError, match="item 1"):  # the first failure in item order
        in_parallel(lambda x: done.append(x) or work(x), list(range(6)), 2, lines.append)
    assert sorted(done) == list(range(6)) and peak[0] == 2  # every item ran, two at a time
    assert lines == ["[track] also failed: ValueError: item 3"]
    assert in_parallel(work, [0, 2], 1, lines.append) == [0, 20]  # one at a time: a plain loop
    with pytest.raises(ConfigError, match="train_parallel: input should be greater than 0"):
        merge(TRACK_PRESETS["tiny"], {"train_parallel": 0})


def test_more_score_subsets_come_as_filter_specs(tmp_path):
    """A spec in ``filters`` is one more subset, named by its label, chosen on the scores like csd."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.track.steps import make_subsets
    from pipeline.schema import u8pairs_to_uids
    from pipeline.subsets.uid_files import read_subset

    uids = [f"{i:032x}" for i in range(10)]
    pq.write_table(pa.table({"uid": uids, "ok": [True] * 10, "csd": np.arange(10.0)}), tmp_path / "s.parquet")
    cfg = merge(TrackConfig(), {"output": str(tmp_path), "subsets": ["csd", "csd30"],
                                "filters": ["csd_best:fraction=0.3,label=csd30"]})  # fmt: skip
    with pytest.raises(ConfigError, match=r"filters\[0\]\.fraction: input should be"):
        merge(cfg, {"filters": ["csd_best:fraction=3,label=csd30"]})
    out = make_subsets(cfg, {}, str(tmp_path / "s.parquet"), lambda line: None)
    assert list(out) == ["csd", "csd30"] and out["csd30"]["size"] == 3 and out["csd"]["size"] == 5
    assert out["csd30"]["rule"] == "csd_best" and out["csd30"]["params"] == {"fraction": 0.3}
    with open(out["csd30"]["path"], "rb") as fh:
        assert u8pairs_to_uids(read_subset(fh, out["csd30"]["path"])) == uids[:3]
