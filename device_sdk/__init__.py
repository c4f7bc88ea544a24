"""Elastify device SDK: pull, verify and run elastic model packages. Depends on torch,
safetensors, tokenizers, numpy and cryptography only; never on the service packages."""

from device_sdk.elastic import ElasticLinear
from device_sdk.latency import SLO
from device_sdk.package import FORMAT_VERSION, Manifest, PackageError, read_manifest, verify_package
from device_sdk.registry import pull
from device_sdk.runtime import ElasticModel, Generation

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
