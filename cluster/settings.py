"""One settings object for the control plane; embedded defaults, production through the environment.

    ELASTIFY_HOME            where embedded mode keeps its files (default ~/.cache/elastify)
    ELASTIFY_DATABASE_URL    sqlite:///… (default: $ELASTIFY_HOME/elastify.db) or postgresql+psycopg://…
    ELASTIFY_RAY_ADDRESS     empty: start a local Ray; or "auto", "ray://host:10001", "host:port"
    ELASTIFY_STORE_URL       a directory (default $ELASTIFY_HOME/store) or s3://bucket/prefix
    ELASTIFY_STORE_ENDPOINT  S3 endpoint URL (SeaweedFS, MinIO, …); credentials from AWS_ACCESS_KEY_ID/…
    ELASTIFY_SIGNING_KEY     PEM file of the Ed25519 key that signs manifests
                             (default $ELASTIFY_HOME/signing_key.pem, generated on first embedded start)
    ELASTIFY_MAX_TASK_RESOURCES  the most one stage task may ask for, e.g. `num_cpus=16,num_gpus=1`
                             (default: what the largest live Ray node offers, when this process joined Ray)
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field
from pathlib import Path

from cluster.capacity import parse_capacity
from workers.store import StoreConfig


class SettingsError(ValueError):
    """Settings that cannot work (e.g. a missing signing key in production)."""


def _home() -> Path:
    return Path(os.environ.get("ELASTIFY_HOME", Path.home() / ".cache" / "elastify")).expanduser()


@dataclass
class Settings:
    home: Path = field(default_factory=_home)
    database_url: str = ""
    ray_address: str = ""
    store_url: str = ""
    store_endpoint: str | None = None
    store_access_key: str | None = None
    store_secret_key: str | None = None
    signing_key_path: Path | None = None
    tenant: str = "default"
    lease_seconds: float = 30.0
    poll_seconds: float = 0.05
    retry_base_seconds: float = 2.0
    retry_max_seconds: float = 120.0
    max_task_resources: str = ""  # cluster.capacity.parse_capacity; empty: the live Ray nodes decide

    def __post_init__(self) -> None:
        self.home = Path(self.home)
        self.database_url = self.database_url or f"sqlite:///{self.home / 'elastify.db'}"
        self.store_url = self.store_url or str(self.home / "store")
        self.signing_key_path = Path(self.signing_key_path or self.home / "signing_key.pem")
        try:
            parse_capacity(self.max_task_resources)
        except ValueError as err:
            raise SettingsError(str(err)) from None

    @classmethod
    def from_env(cls, **overrides) -> Settings:
        env = os.environ.get
        values = dict(
            home=_home(),
            database_url=env("ELASTIFY_DATABASE_URL", ""),
            ray_address=env("ELASTIFY_RAY_ADDRESS", ""),
            store_url=env("ELASTIFY_STORE_URL", ""),
            store_endpoint=env("ELASTIFY_STORE_ENDPOINT") or None,
            store_access_key=env("AWS_ACCESS_KEY_ID") or None,
            store_secret_key=env("AWS_SECRET_ACCESS_KEY") or None,
            signing_key_path=env("ELASTIFY_SIGNING_KEY") or None,
            max_task_resources=env("ELASTIFY_MAX_TASK_RESOURCES", ""),
        )
        return cls(**{**values, **overrides})

    @property
    def store(self) -> StoreConfig:
        return StoreConfig(self.store_url, self.store_endpoint, self.store_access_key, self.store_secret_key)

    # ------------------------------------------------------------------ signing key

    def ensure_signing_key(self) -> None:
        """Generate the Ed25519 key on first start (embedded mode); never overwrite one."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        path = self.signing_key_path
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # O_EXCL: two first starts, one key
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)

    def signing_key_pem(self) -> bytes:
        if not self.signing_key_path.is_file():
            raise SettingsError(
                f"no signing key at {self.signing_key_path}; set ELASTIFY_SIGNING_KEY or run `elastify up` once"
            )
        return self.signing_key_path.read_bytes()

    def public_key_b64(self) -> str:
        """The raw 32-byte public key, base64: what devices pin to verify packages."""
        from cryptography.hazmat.primitives import serialization

        key = serialization.load_pem_private_key(self.signing_key_pem(), password=None)
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return base64.b64encode(raw).decode()
