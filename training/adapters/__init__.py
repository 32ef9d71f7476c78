"""Post-hoc probabilistic adapters on frozen embeddings: ProbVLM (seed 004) and AsymVLM (seed 002).

``probvlm`` and ``asymvlm`` hold the models and losses (pure torch), ``fit`` the CPU training loops on
cached embeddings, ``compare`` the per-method calibration table. The shared metrics are in
``training/eval/calibration.py``.
"""
