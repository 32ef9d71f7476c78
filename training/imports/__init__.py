"""Importers for checkpoints trained elsewhere: open_clip/OpenAI CLIP (``open_clip.py``) and the released
ProLIP models (``prolip_official.py``), converted into our model so every job can use them."""
