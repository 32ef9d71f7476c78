"""What ``python -m jobs.fetch`` resolves, and its presets: which DataComp pool and which evaluation sets, from
which hub, to where (preset → YAML → flags → ``--set``)."""

from __future__ import annotations

from dataclasses import field

from pipeline.common import storage
from pipeline.common.config import ConfigError, Names, Positive, PositiveFloat, config_class
from pipeline.common.storage_config import StorageConfig

SCALES = ("small", "medium", "large", "xlarge")


@config_class
class FetchConfig:
    """DataComp's pool metadata and evaluation sets copied from the Hugging Face hub (jobs/fetch/cli.py)."""

    out: str = ""  # root of the copies, local or s3://: <out>/metadata and <out>/eval unless set below
    # the pool's metadata repo (mlfoundations/datacomp_<scale>); empty = no metadata
    metadata_repo: str = "mlfoundations/datacomp_small"
    metadata_revision: str = "main"  # a branch, tag or commit of the metadata repo
    npz: bool = False  # also the .npz embeddings beside each parquet (CLIP B/32 and L/14; ~3 GB a file)
    metadata_out: str = ""  # where the parquet (and .npz) files go, flat; empty = <out>/metadata
    # the task list whose evaluation sets are fetched (training/eval/tasks/<name>.yaml); empty = none
    eval_tasks: str = "datacomp"
    eval_only: Names = field(default_factory=list)  # only these task names of the list; empty = all
    eval_out: str = ""  # the sets' root (the --eval-root of jobs.evaluate and jobs.track); empty = <out>/eval
    # owner of the webdataset sets' repos, <owner>/wds_<task>_test (DataComp's download_evalsets.py)
    eval_owner: str = "djghosh"
    # revisions tried in order for a datasets-cache set (Flickr, MSCOCO, WinoGAViL): its parquet test split
    eval_hf_revisions: Names = field(default_factory=lambda: ["main", "refs/convert/parquet"])
    hub_endpoint: str = ""  # the hub's URL; empty = $HF_ENDPOINT, else https://huggingface.co
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment
    staging: str = ""  # local folder for the partial files of an s3:// copy; empty = the system temp dir
    workers: Positive = 8  # files transferred at once
    attempts: Positive = 3  # downloads of one file before bytes that never match its hash fail the set
    verify: bool = False  # hash the copies already in place again (else their record and size are trusted)
    progress_s: PositiveFloat = 10.0  # seconds between progress lines

    def __post_init__(self) -> None:
        if not self.metadata_repo and not self.eval_tasks:
            raise ConfigError("metadata_repo, eval_tasks: both empty, nothing to fetch")
        if self.eval_only and not self.eval_tasks:
            raise ConfigError("eval_only: needs eval_tasks (the task list the names are from)")

    def metadata_root(self) -> str:
        return self.metadata_out or (storage.join(self.out, "metadata") if self.out else "")

    def eval_root(self) -> str:
        return self.eval_out or (storage.join(self.out, "eval") if self.out else "")


def _scale(scale: str, **more) -> FetchConfig:
    return FetchConfig(metadata_repo=f"mlfoundations/datacomp_{scale}", **more)


# One preset per DataComp scale: its pool's parquet files and the 38 evaluation sets; --set npz=true adds the
# embeddings, --set eval_tasks= (empty) skips the sets, --set metadata_repo= (empty) fetches only the sets.
FETCH_PRESETS: dict[str, FetchConfig] = {f"datacomp-{s}": _scale(s) for s in SCALES}
FETCH_PRESETS["eval"] = FetchConfig(metadata_repo="")  # the evaluation sets alone
