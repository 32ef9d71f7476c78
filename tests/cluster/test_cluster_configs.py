"""Offline checks of the cluster configs in cluster/ (no cloud, no Kubernetes, no Ray cluster).

- Cluster launcher YAMLs go through Ray's own ``prepare_config`` + ``validate_config`` (the JSON schema in
  the wheel): a misspelled key fails. The fake-cluster YAML is read as autoscaler v2 reads it.
- KubeRay manifests: there is no CRD schema offline, so a whitelist of the fields KubeRay's ray.io/v1 types
  accept (RayCluster, RayJob; KubeRay 1.5+) plus structural rules, and the RayJobs against our job list.
- Every ``--set`` in a RayJob entrypoint resolves against the job's presets, so a renamed config key fails
  here rather than at job start on a cluster.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from pipeline.common.config import resolve
from pipeline.common.placement import DATA_ROLE, LABEL_KEY, TRAIN_ROLE

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
REQUIRED_JOBS = ("build_dataset", "train", "filter", "evaluate", "track", "fetch")
RAY_IMAGE = "rayproject/ray:2.60.0-py311-gpu"

# Fields of KubeRay's ray.io/v1 Go types (raycluster_types.go, rayjob_types.go) that these manifests may use.
RAYCLUSTER_SPEC = {
    "rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec", "workerGroupSpecs",
    "authOptions", "suspend", "managedBy", "headServiceAnnotations", "gcsFaultToleranceOptions",
    "upgradeStrategy",
}  # fmt: skip
AUTOSCALER_OPTIONS = {
    "resources", "image", "imagePullPolicy", "securityContext", "idleTimeoutSeconds", "upscalingMode",
    "version", "env", "envFrom", "volumeMounts",
}  # fmt: skip
AUTH_OPTIONS = {"mode", "secretName"}
HEAD_GROUP = {
    "template", "headService", "enableIngress", "rayStartParams", "serviceType", "resources", "labels",
}  # fmt: skip
WORKER_GROUP = {
    "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds", "rayStartParams",
    "template", "scaleStrategy", "numOfHosts", "suspend", "resources", "labels",
}  # fmt: skip
RAYJOB_SPEC = {
    "entrypoint", "metadata", "runtimeEnvYAML", "jobId", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished",
    "activeDeadlineSeconds", "rayClusterSpec", "clusterSelector", "suspend", "submissionMode",
    "submitterPodTemplate", "entrypointNumCpus", "entrypointNumGpus", "entrypointResources", "backoffLimit",
    "deletionStrategy", "managedBy", "submitterConfig",
}  # fmt: skip


def load(path: Path) -> dict:
    with open(path) as fh:
        return yaml.safe_load(fh)


# --- cluster launcher YAML (Ray's validation) ---------------------------------------------------------


def ray_validate(config: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_aws_yaml_passes_rays_own_validation() -> None:
    prepared = ray_validate(load(CLUSTER / "aws.yaml"))
    assert prepared["available_node_types"]["head"]["max_workers"] == 0


@pytest.mark.parametrize(
    "path, typo",
    [
        ((), "idle_timeout_minute"),
        (("available_node_types", "cpu"), "min_worker"),
        (("available_node_types", "gpu"), "label"),
        (("docker",), "head_run_option"),
    ],
)
def test_a_misspelled_key_fails_validation(path: tuple[str, ...], typo: str) -> None:
    config = load(CLUSTER / "aws.yaml")
    node = config
    for key in path:
        node = node[key]
    node[typo] = node.get(typo.rstrip("s"), 1)
    with pytest.raises(jsonschema.ValidationError, match=typo):
        ray_validate(config)


def test_aws_layout_head_without_tasks_labelled_cpu_and_gpu_types() -> None:
    config = load(CLUSTER / "aws.yaml")
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--num-cpus=0" in head_start and "--dashboard-host=127.0.0.1" in head_start
    assert "0.0.0.0" not in (CLUSTER / "aws.yaml").read_text()  # the dashboard only through a tunnel
    assert "RAY_enable_autoscaler_v2=1" in head_start  # label-aware scale-up
    worker_start = " ".join(config["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in head_start and "RAY_AUTH_MODE=token" in worker_start  # token auth
    assert config["file_mounts"]["/home/ray/.ray/auth_token"] == "~/.ray/prolip-auth-token"
    # The project's image (cluster/Dockerfile, FROM Ray's): the same one the KubeRay manifests run.
    kuberay = load(CLUSTER / "kuberay" / "raycluster.yaml")
    images = {c["image"] for g in [kuberay["spec"]["headGroupSpec"], *kuberay["spec"]["workerGroupSpecs"]]
              for c in g["template"]["spec"]["containers"]}  # fmt: skip
    assert (
        images == {config["docker"]["image"]} and f"FROM {RAY_IMAGE}" in (CLUSTER / "Dockerfile").read_text()
    )
    assert types["cpu"]["labels"] == {LABEL_KEY: DATA_ROLE} and types["gpu"]["labels"] == {
        LABEL_KEY: TRAIN_ROLE
    }
    assert types["cpu"]["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
    assert types["cpu"]["min_workers"] == 0 == types["gpu"]["min_workers"]
    assert types["gpu"]["max_workers"] >= 1 and types["gpu"]["node_config"]["InstanceType"] == "p5.48xlarge"
    for name, spec in types.items():
        assert "IamInstanceProfile" in spec["node_config"], name  # S3 through an instance profile
        opts = (
            config["docker"]["head_run_options"] if name == "head" else spec["docker"]["worker_run_options"]
        )
        assert any(o.startswith("--shm-size=") for o in opts), name
    text = (CLUSTER / "aws.yaml").read_text()
    assert "aws_secret_access_key" not in text.lower() and "AKIA" not in text


def test_fake_cluster_yaml_is_what_autoscaler_v2_reads() -> None:
    """v2 reads the file through ``prepare_config`` (defaults merged) and the schema, as for a cloud."""
    from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig

    config = load(CLUSTER / "fake_cluster.yaml")
    prepared = AutoscalingConfig(copy.deepcopy(config), skip_content_hash=True)
    assert config["provider"]["module"].endswith("fake_multi_node.node_provider.FakeMultiNodeProvider")
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"]["CPU"] == 0
    workers = {n: t for n, t in types.items() if n != config["head_node_type"]}
    assert {n: t["labels"] for n, t in workers.items()} == {
        "data": {LABEL_KEY: DATA_ROLE},
        "train": {LABEL_KEY: TRAIN_ROLE},
    }
    assert prepared.get_node_labels("train") == {LABEL_KEY: TRAIN_ROLE}
    assert workers["train"]["resources"]["fake_gpu"] == 1 and "fake_gpu" not in workers["data"]["resources"]
    assert workers["data"]["min_workers"] == 1 and workers["train"]["min_workers"] == 0
    assert 0 < config["idle_timeout_minutes"] <= 0.5


def test_runtime_env_yaml_is_a_valid_ray_runtime_env() -> None:
    from ray.runtime_env import RuntimeEnv

    spec = load(CLUSTER / "runtime_env.yaml")
    env = RuntimeEnv(**spec, working_dir=".")
    assert env["env_vars"]["NO_ALBUMENTATIONS_UPDATE"] == "1"
    assert all(isinstance(v, str) for v in spec["env_vars"].values())


# --- KubeRay manifests (whitelist + structure) --------------------------------------------------------


def check_keys(node: dict, allowed: set[str], where: str) -> None:
    unknown = set(node) - allowed
    if unknown:
        raise ValueError(f"{where}: fields KubeRay does not accept: {sorted(unknown)}")


def check_pod_template(template: dict, where: str) -> None:
    containers = template["spec"]["containers"]
    if not containers or not all(c.get("name") and c.get("image") for c in containers):
        raise ValueError(f"{where}.template: every container needs a name and an image")


def check_raycluster(doc: dict) -> None:
    """KubeRay's RayCluster fields and the shape our jobs rely on; raises ValueError naming the field."""
    check_keys(doc, {"apiVersion", "kind", "metadata", "spec"}, "RayCluster")
    if doc["apiVersion"] != "ray.io/v1" or doc["kind"] != "RayCluster":
        raise ValueError("RayCluster: apiVersion ray.io/v1, kind RayCluster")
    spec = doc["spec"]
    check_keys(spec, RAYCLUSTER_SPEC, "spec")
    check_keys(spec.get("autoscalerOptions", {}), AUTOSCALER_OPTIONS, "spec.autoscalerOptions")
    check_keys(spec.get("authOptions", {}), AUTH_OPTIONS, "spec.authOptions")
    head = spec["headGroupSpec"]
    check_keys(head, HEAD_GROUP, "spec.headGroupSpec")
    check_pod_template(head["template"], "headGroupSpec")
    groups = [("spec.headGroupSpec", head)]
    for i, group in enumerate(spec.get("workerGroupSpecs", [])):
        where = f"spec.workerGroupSpecs[{i}]"
        check_keys(group, WORKER_GROUP, where)
        missing = {"groupName", "minReplicas", "maxReplicas", "template"} - set(group)
        if missing:
            raise ValueError(f"{where}: missing {sorted(missing)}")
        if not 0 <= group["minReplicas"] <= group["maxReplicas"]:
            raise ValueError(f"{where}: need 0 <= minReplicas <= maxReplicas")
        check_pod_template(group["template"], where)
        groups.append((where, group))
    for where, group in groups:
        for field in ("rayStartParams", "labels", "resources"):
            bad = {k: v for k, v in group.get(field, {}).items() if not isinstance(v, str)}
            if bad:  # map[string]string in KubeRay: an unquoted 0 or true is rejected by the API server
                raise ValueError(f"{where}.{field}: values must be strings, got {bad}")


def test_raycluster_fields_autoscaling_auth_and_groups() -> None:
    doc = load(CLUSTER / "kuberay" / "raycluster.yaml")
    check_raycluster(doc)
    spec = doc["spec"]
    assert spec["rayVersion"] == "2.60.0" and spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["version"] == "v2" and spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"  # port-forward only
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert groups["cpu"]["labels"] == {LABEL_KEY: DATA_ROLE} and groups["gpu"]["labels"] == {
        LABEL_KEY: TRAIN_ROLE
    }
    assert all(g["minReplicas"] == 0 for g in groups.values())
    gpu_limits = groups["gpu"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu_limits["nvidia.com/gpu"] == "8"


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda s: s.update(enableInTreeAutoscale=True), "enableInTreeAutoscale"),
        (lambda s: s["workerGroupSpecs"][0].update(minReplica=0), "minReplica"),
        (lambda s: s["autoscalerOptions"].update(idleTimeout=30), "idleTimeout"),
        (lambda s: s["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}), "rayStartParams"),
        (lambda s: s["workerGroupSpecs"][1].pop("maxReplicas"), "maxReplicas"),
    ],
)
def test_raycluster_check_rejects_a_wrong_field(mutate, field: str) -> None:
    doc = load(CLUSTER / "kuberay" / "raycluster.yaml")
    mutate(doc["spec"])
    with pytest.raises(ValueError, match=field):
        check_raycluster(doc)


def rayjobs() -> dict[str, dict]:
    return {
        p.stem.removeprefix("rayjob-"): load(p) for p in sorted((CLUSTER / "kuberay").glob("rayjob-*.yaml"))
    }


def entrypoint_argv(doc: dict) -> list[str]:
    return shlex.split(doc["spec"]["entrypoint"])


def test_a_rayjob_per_job_each_naming_an_existing_module() -> None:
    jobs = rayjobs()
    assert set(jobs) == set(REQUIRED_JOBS)
    cluster_name = load(CLUSTER / "kuberay" / "raycluster.yaml")["metadata"]["name"]
    for verb, doc in jobs.items():
        assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob", verb
        check_keys(doc["spec"], RAYJOB_SPEC, f"rayjob-{verb}.spec")
        assert doc["spec"]["clusterSelector"] == {"ray.io/cluster": cluster_name}, verb
        argv = entrypoint_argv(doc)
        assert argv[:3] == ["python", "-m", f"jobs.{verb}"], (verb, argv[:3])
        module = ROOT / "jobs" / f"{verb}.py"
        package = ROOT / "jobs" / verb / "__main__.py"  # a multi-step job is a package run by its __main__
        assert module.is_file() or package.is_file(), f"jobs/{verb}.py or jobs/{verb}/__main__.py is missing"
        assert isinstance(yaml.safe_load(doc["spec"]["runtimeEnvYAML"]), dict), verb


def _presets(verb: str):
    if verb == "build_dataset":
        from pipeline.config import BUILD_PRESETS as presets
    elif verb == "train":
        from training.config import TRAIN_PRESETS as presets
    elif verb == "track":
        from jobs.track.config import TRACK_PRESETS as presets
    elif verb == "filter":
        from jobs.filter.run import FILTER_PRESETS as presets
    elif verb == "fetch":
        from jobs.fetch.config import FETCH_PRESETS as presets
    else:
        from training.eval.config import EVAL_PRESETS as presets
    return presets


@pytest.mark.parametrize("verb", REQUIRED_JOBS)
def test_rayjob_presets_and_overrides_resolve(verb: str) -> None:
    argv = entrypoint_argv(rayjobs()[verb])
    preset = argv[argv.index("--preset") + 1]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    resolve(_presets(verb), preset, None, sets)  # raises ConfigError naming an unknown key


def test_placement_selectors_in_rayjobs_match_the_node_labels() -> None:
    wanted = {f"{LABEL_KEY}={DATA_ROLE}", f"{LABEL_KEY}={TRAIN_ROLE}"}
    for verb in ("build_dataset", "train", "track"):
        sets = [s for s in entrypoint_argv(rayjobs()[verb]) if "label_selector" in s]
        assert sets, verb
        assert {s.split("label_selector.", 1)[1] for s in sets} <= wanted, sets
