"""An encoding pool takes the GPUs a cluster has unless told otherwise (``gpu_pool``): one GPU an actor where
GPUs are up or the autoscaler can add a GPU node, one actor per such GPU, none on a CPU-only cluster."""

from __future__ import annotations

import pytest

from training.infer import batch_inference
from training.infer.batch_inference import cluster_gpus, gpu_pool


@pytest.mark.parametrize(
    "cluster, asked, pool",
    [
        ((0.0, 0.0), (None, None), (1, 0.0)),  # a laptop: one CPU actor
        ((8.0, 8.0), (None, None), (8, 1.0)),  # a GPU node up: one actor per GPU
        ((16.0, 8.0), (None, 0.5), (32, 0.5)),  # half a GPU each: two actors per GPU
        ((0.0, 8.0), (None, None), (8, 1.0)),  # none up yet: the first GPU node the autoscaler brings
        ((8.0, 8.0), (2, None), (2, 1.0)),  # the actors given, the GPUs taken
        ((8.0, 8.0), (3, 0.0), (3, 0.0)),  # both given: the cluster is not asked
    ],
)
def test_unset_values_come_from_the_clusters_gpus(monkeypatch, cluster, asked, pool) -> None:
    monkeypatch.setattr(batch_inference, "cluster_gpus", lambda: cluster)
    assert gpu_pool(*asked) == pool


@pytest.mark.ray
def test_a_cpu_only_local_ray_gives_one_cpu_actor(ray_local) -> None:
    assert cluster_gpus() == (0.0, 0.0)
    assert gpu_pool(None, None) == (1, 0.0)
