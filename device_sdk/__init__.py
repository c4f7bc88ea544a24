"""Elastify device SDK: pull, verify and run elastic model packages. Depends on torch,
safetensors, tokenizers, numpy and cryptography only; never on the service packages."""

import os

# Idle OpenMP threads sleep instead of spinning. A device is shared with other programs, and
# a spinning worker there steals the core the decode loop needs: on a busy 2-core machine
# this took SmolLM2 int8 decode from ~40-300 ms to 17 ms a token. Only takes effect when
# this package is imported before torch; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from device_sdk.elastic import ElasticLinear  # noqa: E402 (after the OpenMP setting)
from device_sdk.latency import SLO  # noqa: E402
from device_sdk.package import FORMAT_VERSION, Manifest, PackageError, read_manifest, verify_package  # noqa: E402
from device_sdk.registry import pull  # noqa: E402
from device_sdk.runtime import ElasticModel, Generation  # noqa: E402

__all__ = [
    "FORMAT_VERSION",
    "SLO",
    "ElasticLinear",
    "ElasticModel",
    "Generation",
    "Manifest",
    "PackageError",
    "pull",
    "read_manifest",
    "verify_package",
]
