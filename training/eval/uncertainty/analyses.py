"""Runs the uncertainty analyses of ``training/eval/uncertainty/measures.py`` on gathered eval embeddings.

Which set serves which analysis: σ² per modality and image ⊂ own caption on the first retrieval task;
σ² vs caption length on every retrieval and hierarchy caption; level ordering and traversal on the first
hierarchy task; BPRW on the first classification task; each class's prompt σ² against its zero-shot recall
on every classification task. Original ⊂ masked needs fresh encodings of masked inputs: the driver's
``Encoder`` encodes the first ``MASKED_SAMPLES`` images/captions of the retrieval task (text: 75% of
content tokens → [MASK] with ``pipeline.ingest.masking.mask_text_tokens``, never pad/end, and removed from the
caption when the checkpoint trained with ``data.text_mask_mode`` "drop" or "salient"; image: 25% of
patches kept with ``choose_kept_patches`` — the §4.1 masking of training).
Deterministic checkpoints get ``uncertainty.NOT_APPLICABLE`` for every analysis.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pipeline.common.storage import LOCAL, Storage
from pipeline.ingest.masking import choose_kept_patches, drop_masked_tokens, mask_text_tokens
from training.eval import hf_sets
from training.eval import sets as eval_sets
from training.eval.metrics import zero_shot_scores
from training.eval.uncertainty import measures as uncertainty
from training.eval.uncertainty.plots import plot_all
from training.infer.encode import Encoder

MASKED_SAMPLES = 128
ANALYSES = (
    "sigma2_modality",
    "sigma2_length",
    "hierarchy_order",
    "inclusion",
    "bprw",
    "traversal",
    "class_uncertainty",
)


def _first(data: list, kind: str) -> Any:
    return next((d for d in data if d.task.kind == kind), None)


@torch.inference_mode()
def masked_inclusion(
    encoder: Encoder, images: list[bytes], captions: list[str], seed: int = 0
) -> tuple[dict, dict]:
    """Fractions with H(Z ⊂ Z_masked) > 0 for texts and images; also the H arrays for plotting."""
    model, cfg, tok = encoder.model, encoder.config, encoder.tokenizer
    device = encoder.device
    tokens = tok.encode_batch(captions, cfg.context_length)
    protected = () if tok.start_id is None else (tok.start_id,)
    masked = mask_text_tokens(
        tokens, tok.pad_id, tok.end_id, tok.mask_id, 0.75, rng=seed, protected_ids=protected
    )
    # As the model was trained: the words removed ("salient" removes the model's choice of words; here, as
    # for "drop", random ones, so the analysis asks the same question of every checkpoint).
    if encoder.extra.get("text_mask_mode") in ("drop", "salient"):
        masked = drop_masked_tokens(masked, tok.mask_id, tok.pad_id)
    t_mu, t_lv = model.encode_text(torch.as_tensor(tokens).to(device))
    m_mu, m_lv = model.encode_text(torch.as_tensor(masked).to(device))
    out = {"text": uncertainty.inclusion_rate(*(x.float().cpu().numpy() for x in (t_mu, t_lv, m_mu, m_lv)))}
    h = {
        "text ⊂ masked": uncertainty.hypothesis(*(x.float().cpu().numpy() for x in (t_mu, t_lv, m_mu, m_lv)))
    }
    pixels, ok = encoder.preprocess(images)
    pixels = torch.from_numpy(pixels[ok]).to(device)
    keep = torch.from_numpy(choose_kept_patches(cfg.n_patches, len(pixels), 0.25, rng=seed + 1)).to(device)
    v = model.encode_image(pixels) + model.encode_image(pixels, keep)  # (μ, log σ², μ_masked, log σ²_masked)
    v = [x.float().cpu().numpy() for x in v]
    out["image"] = uncertainty.inclusion_rate(*v)
    h["image ⊂ masked"] = uncertainty.hypothesis(*v)
    out["text"]["mask_ratio"], out["image"]["keep_ratio"] = 0.75, 0.25
    return out, h


Found = dict[str, Any]
Arrays = dict[str, np.ndarray]
_MISSING = "not run: the task list has no {} task"


def _retrieval_analyses(ret: Any, encoder: Encoder, seed: int, store: Storage) -> tuple[Found, Arrays]:
    """σ² per modality, image ⊂ own caption, and original ⊂ masked on the first shard's samples."""
    found: Found = {
        "sigma2_modality": {
            "task": ret.task.name,
            **uncertainty.modality_sigma2(ret.image_logvar, ret.text_logvar),
        }
    }
    arrays: Arrays = {
        "image_trace": uncertainty.trace(ret.image_logvar),
        "text_trace": uncertainty.trace(ret.text_logvar),
    }
    own = np.repeat(np.arange(len(ret.captions)), [len(c) for c in ret.captions])
    pairs = (ret.image_mu[own], ret.image_logvar[own], ret.text_mu, ret.text_logvar)
    inc = {"image_in_caption": uncertainty.inclusion_rate(*pairs, groups=own)}
    arrays["H_image ⊂ caption"] = uncertainty.hypothesis(*pairs)
    n = min(MASKED_SAMPLES, len(ret.captions))
    if ret.task.hf_dataset:  # a set in the datasets cache (DataComp's Flickr / MSCOCO)
        rows = list(
            hf_sets.iter_rows(hf_sets.validate_task(ret.task, store)[0], ret.task.kind, store, limit=n)
        )
    else:
        first_shard = eval_sets.shard_paths(ret.task, store)[0]
        rows = list(eval_sets.iter_rows(first_shard, ret.task.kind, store, limit=n))
    masked, h = masked_inclusion(
        encoder,
        [r["image"] for r in rows],
        [eval_sets.split_captions(r["captions"])[0] for r in rows],
        seed,
    )
    inc.update({"original_in_masked_text": masked["text"], "original_in_masked_image": masked["image"]})
    inc["paper_original_in_masked"] = "> 0.70"
    found["inclusion"] = {"task": ret.task.name, **inc}
    arrays.update({f"H_{k}": v for k, v in h.items()})
    return found, arrays


def _length_analysis(texts: list) -> tuple[Found, Arrays]:
    """σ² vs caption length over every retrieval and hierarchy caption, and per task (the sets can pull
    opposite ways: the demo's retrieval captions name the most in their shortest wording)."""
    caps = [c for d in texts for cs in d.captions for c in cs]
    lv = np.concatenate([d.text_logvar for d in texts])
    # The picture each caption describes, numbered across the tasks: the interval resamples pictures.
    sizes = [len(cs) for d in texts for cs in d.captions]
    pictures = np.repeat(np.arange(len(sizes)), sizes)
    per_task = {
        d.task.name: uncertainty.length_correlation([c for cs in d.captions for c in cs], d.text_logvar)[
            "spearman_words_vs_trace"
        ]
        for d in texts
    }
    found = {
        "sigma2_length": {
            "tasks": [d.task.name for d in texts],
            **uncertainty.length_correlation(caps, lv, groups=pictures),
            "per_task": per_task,
        }
    }
    arrays = {
        "caption_words": uncertainty.word_counts(caps),
        "caption_trace": uncertainty.trace(lv),
    }
    return found, arrays


def _hierarchy_analyses(hier: Any, encoder: Encoder) -> tuple[Found, Arrays]:
    """Level ordering of tr(Σ) and the image traversal towards the empty caption."""
    levels = min(len(c) for c in hier.captions)
    counts = [len(c) for c in hier.captions]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    idx = starts[:, None] + np.arange(levels)[None, :]  # (n, L): level k of image i
    tr = uncertainty.trace(hier.text_logvar)[idx]
    by_level = [cs[:levels] for cs in hier.captions]
    found: Found = {"hierarchy_order": {"task": hier.task.name, **uncertainty.hierarchy_order(tr, by_level)}}
    level = np.concatenate([np.arange(c) for c in counts])
    e_mu, e_lv = encoder.texts([""])
    found["traversal"] = {
        "task": hier.task.name,
        **uncertainty.traversal(
            hier.image_mu, hier.image_logvar, hier.text_mu, hier.text_logvar, level, e_mu[0], e_lv[0]
        ),
    }
    return found, {"level_traces": tr}


def _bprw_analysis(cls: Any, seed: int) -> Found:
    c, t = len(cls.classnames), len(cls.templates)
    return {
        "task": cls.task.name,
        **uncertainty.bprw_analysis(
            cls.text_mu.reshape(c, t, -1),
            cls.text_logvar.reshape(c, t, -1),
            cls.image_mu,
            cls.image_logvar,
            cls.labels,
            seed=seed,
        ),
    }


def _class_analysis(classification: list) -> Found:
    """Per zero-shot task: its classes' prompt tr(Σ) against their zero-shot recall, scored as the task is."""
    out: Found = {}
    for d in classification:
        c, t = len(d.classnames), len(d.templates)
        prompt_mu, prompt_lv = d.text_mu.reshape(c, t, -1), d.text_logvar.reshape(c, t, -1)
        # Scored again rather than kept from task_metrics: holding every task's (n, C) matrix until the
        # analyses run would cost more memory (ImageNet: 50k × 1000 float64) than this recompute costs time.
        scores = zero_shot_scores(prompt_mu, prompt_lv, d.image_mu, d.image_logvar)
        out[d.task.name] = {
            "classes": list(d.classnames),
            **uncertainty.class_uncertainty(prompt_lv, scores, d.labels),
        }
    return out


def run_analyses(
    data: list, encoder: Encoder, plot_dir: str, seed: int = 0, store: Storage = LOCAL, subject: str = ""
) -> tuple[dict, list[str]]:
    """(analyses dict, PNG paths) for the gathered ``TaskData`` list; ``store`` reads the eval shards;
    ``subject`` (the run and model) heads every plot."""
    if not encoder.probabilistic:
        return {name: uncertainty.NOT_APPLICABLE for name in ANALYSES}, []
    found: Found = {}
    arrays: Arrays = {}
    ret, hier, cls = (
        _first(data, "retrieval"),
        _first(data, "hierarchy"),
        _first(data, "zeroshot_classification"),
    )
    if ret is not None:
        part, more = _retrieval_analyses(ret, encoder, seed, store)
        found.update(part)
        arrays.update(more)
    else:
        found["sigma2_modality"] = found["inclusion"] = _MISSING.format("retrieval")
    texts = [d for d in data if d.task.kind in ("retrieval", "hierarchy")]
    if texts:
        part, more = _length_analysis(texts)
        found.update(part)
        arrays.update(more)
    else:
        found["sigma2_length"] = _MISSING.format("retrieval or hierarchy")
    if hier is not None:
        part, more = _hierarchy_analyses(hier, encoder)
        found.update(part)
        arrays.update(more)
    else:
        found["hierarchy_order"] = found["traversal"] = _MISSING.format("hierarchy")
    found["bprw"] = _bprw_analysis(cls, seed) if cls is not None else _MISSING.format("classification")
    classification = [d for d in data if d.task.kind == "zeroshot_classification"]
    found["class_uncertainty"] = (
        _class_analysis(classification) if classification else _MISSING.format("classification")
    )
    return found, plot_all(found, arrays, plot_dir, subject)
