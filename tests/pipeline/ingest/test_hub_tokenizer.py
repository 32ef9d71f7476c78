"""``hf-hub:REPO`` tokenizers come from the local Hugging Face cache first (what the cluster image fills).

No test may reach the Hub, so the cache is laid out here by hand, as ``huggingface_hub`` writes it
(``models--{org}--{name}/snapshots/{commit}/tokenizer.json`` and ``refs/main``), with a tokenizer we trained;
a fresh process with ``HF_HUB_CACHE`` pointing there and the Hub switched off resolves
``hf-hub:timm/ViT-B-16-SigLIP`` to it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.ingest.tokenizer import TOKENIZER_FILE, train_tokenizer

ROOT = Path(__file__).resolve().parents[3]


def test_hub_spec_reads_the_cached_tokenizer_offline(tmp_path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--timm--ViT-B-16-SigLIP"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    tok = train_tokenizer(
        [f"a photo of a {w} dog" for w in ("red", "big", "small", "brown")] * 5, vocab_size=280
    )
    tok.save(tmp_path / "saved")
    (snapshot / TOKENIZER_FILE).write_bytes((tmp_path / "saved" / TOKENIZER_FILE).read_bytes())
    code = (
        "import json; from pipeline.ingest.tokenizer import tokenizer_from_spec as t\n"
        "k = t('hf-hub:timm/ViT-B-16-SigLIP', 'canonicalize')\n"
        "print(json.dumps({'ids': k.encode_batch(['A photo of a RED dog!'], 12)[0].tolist(), 'v': k.vocab_size}))"
    )
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
    }
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    want = tok.encode_batch(["a photo of a red dog"], 12)[
        0
    ].tolist()  # SigLIP's cleaning: lower, no punctuation
    assert got["ids"] == want and got["v"] == tok.vocab_size
