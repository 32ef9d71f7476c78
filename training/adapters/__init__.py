"""Post-hoc probabilistic adapters on frozen embeddings: ProbVLM and AsymVLM (docs/math.md, docs/adapters.md).

``probvlm`` and ``asymvlm`` hold the models and losses (pure torch), ``fit`` the CPU training loops on
cached embeddings, ``compare`` the per-method calibration table. The shared metrics are in
``training/eval/uncertainty/calibration.py``.
"""
