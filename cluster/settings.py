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
    ELASTIFY_SOURCE_ROOTS    directories builds may read models and data from, separated by ':'
                             (default: $ELASTIFY_HOME/models, where `elastify assets prepare` puts SmolLM2,
                             and the installed asset packages); anything else is uploaded (POST /v1/sources)
    ELASTIFY_MAX_UPLOAD_BYTES    the largest one upload may be (default 8 GiB)
    ELASTIFY_UPLOAD_QUOTA_BYTES  the most a tenant's uploads may hold together (default 32 GiB)
    ELASTIFY_GPU_STAGE_SECONDS   what one GPU of one stage reserves against the tenant's GPU-hour quota
                             at submit, in seconds (default 600; nothing in a spec says how long a stage runs)
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


GPU_STAGE_SECONDS = 600.0  # the default per-GPU-stage reservation (cluster.service.GpuNeed)


def _home() -> Path:
    return Path(os.environ.get("ELASTIFY_HOME", Path.home() / ".cache" / "elastify")).expanduser()


def _byte_counts(**values: str | None) -> dict[str, int]:
    """The byte counts set in the environment, as ints (unset ones keep their defaults)."""
    counts = {}
    for name, value in values.items():
        if value:
            if not value.isdigit():
                raise SettingsError(f"{name} must be a whole number of bytes; got {value!r}")
            counts[name] = int(value)
    return counts


def _seconds(**values: str | None) -> dict[str, float]:
    """The durations set in the environment, as floats (unset ones keep their defaults)."""
    durations = {}
    for name, value in values.items():
        if value:
            try:
                durations[name] = float(value)
            except ValueError:
                raise SettingsError(f"ELASTIFY_{name.upper()} must be a number of seconds; got {value!r}") from None
    return durations


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
    source_roots: str = ""  # os.pathsep-separated absolute directories; empty: the embedded default below
    max_upload_bytes: int = 8 << 30
    upload_quota_bytes: int = 32 << 30
    gpu_stage_seconds: float = GPU_STAGE_SECONDS
    # A database outage: the scheduler retries after base, 2 × base, … up to max seconds (Scheduler.run).
    db_retry_base_seconds: float = 0.5
    db_retry_max_seconds: float = 30.0

    def __post_init__(self) -> None:
        self.home = Path(self.home)
        self.database_url = self.database_url or f"sqlite:///{self.home / 'elastify.db'}"
        self.store_url = self.store_url or str(self.home / "store")
        self.signing_key_path = Path(self.signing_key_path or self.home / "signing_key.pem")
        try:
            parse_capacity(self.max_task_resources)
        except ValueError as err:
            raise SettingsError(str(err)) from None
        if not self.gpu_stage_seconds > 0 or self.gpu_stage_seconds == float("inf"):
            raise SettingsError(f"ELASTIFY_GPU_STAGE_SECONDS must be a positive number of seconds; got {self.gpu_stage_seconds!r}")
        relative = [root for root in self.source_roots.split(os.pathsep) if root and not Path(root).is_absolute()]
        if relative:
            raise SettingsError(f"ELASTIFY_SOURCE_ROOTS must list absolute directories; got {relative}")

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
            source_roots=env("ELASTIFY_SOURCE_ROOTS", ""),
            **_seconds(gpu_stage_seconds=env("ELASTIFY_GPU_STAGE_SECONDS")),
            **_byte_counts(max_upload_bytes=env("ELASTIFY_MAX_UPLOAD_BYTES"),
                           upload_quota_bytes=env("ELASTIFY_UPLOAD_QUOTA_BYTES")),
        )
        return cls(**{**values, **overrides})

    @property
    def allowed_source_roots(self) -> tuple[Path, ...]:
        """Where builds may read sources (cluster.sources). The embedded default: the models directory of this
        home and of the asset cache (`elastify assets prepare`; the same unless ELASTIFY_HOME differs), and
        the installed asset packages (the SmolLM2 GGUF, MiniLM, the evaluation data)."""
        if self.source_roots:
            return tuple(Path(root) for root in self.source_roots.split(os.pathsep) if root)
        # lazy: planning a spec imports no pipeline module past the contract
        from pipeline.assets import ASSET_PACKAGES, AssetError, elastify_home, package_dir

        roots = [self.home / "models", elastify_home() / "models"]
        for module in ASSET_PACKAGES:
            try:
                roots.append(package_dir(module))
            except AssetError:  # not installed here: nothing to read from it either
                pass
        return tuple(dict.fromkeys(roots))

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
