"""What makes a track's numbers stand beside DataComp's: its CLIP-score baselines, the locked recipe, its
pool's rules, starting points from existing shards or models, and the submission it would package."""
