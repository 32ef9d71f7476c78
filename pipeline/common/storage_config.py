"""A job's storage settings, one sub-config every job config holds (a module of its own: the config
dialect's errors already import the storage object, so it cannot import the dialect back)."""

from __future__ import annotations

from pipeline.common.config import config_class
from pipeline.common.storage import Storage


@config_class
class StorageConfig:
    """A job's storage settings, declared once and held by every job config as its ``storage`` field.

    Credentials are not settings: they come from the AWS environment chain when ``store()`` runs, so a
    config (printed, saved in a manifest) never carries one. The flat key ``s3_endpoint`` of older configs
    and ``--set`` lines is read as ``storage.s3_endpoint`` (``pipeline.common.config.MOVED_KEYS``).
    """

    s3_endpoint: str = ""  # e.g. http://127.0.0.1:8333 (else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)

    def store(self) -> Storage:
        """The storage object these settings and the environment's credentials give."""
        return Storage.from_env(self.s3_endpoint)
