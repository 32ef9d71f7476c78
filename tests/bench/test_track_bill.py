"""docs/cluster.md's bill is what bench/track_bill.py computes from the presets, the FLOP counts and the
measured rates now: a preset or a count that changes without the page fails here."""

from __future__ import annotations

from pathlib import Path

from bench import track_bill

ROOT = Path(__file__).resolve().parents[2]


def load():
    return track_bill


def test_the_bill_on_the_page_is_the_one_computed_now() -> None:
    bill = load()
    text = bill.render()
    doc = (ROOT / "docs" / "cluster.md").read_text()
    shown = doc.split(bill.BEGIN, 1)[1].split(bill.END, 1)[0]
    assert shown.strip() == text.strip(), "docs/cluster.md's bill is stale: python -m bench.track_bill"
    # every step of a track is priced, at both scales, and the medium track costs more
    for scale in ("small", "medium"):
        assert f"**{scale} track**" in text
    for step in ("build:", "7 trainings", "scoring", "7 evaluations × 38 tasks", "head"):
        assert text.count(step) == 2, step
    c = bill.counts()
    small, medium = (bill.bill(rows, c) for rows in bill.SCALES.values())
    assert sum(x.cost[0] for x in medium) > 3 * sum(x.cost[0] for x in small)
