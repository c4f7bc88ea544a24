"""Elastify device SDK: read, verify and run elastic model packages. Depends on torch,
safetensors, tokenizers, numpy and cryptography only; never on the service packages."""

from device_sdk.elastic import ElasticLinear
from device_sdk.package import FORMAT_VERSION, Manifest, PackageError, read_manifest, verify_package

__all__ = ["FORMAT_VERSION", "ElasticLinear", "Manifest", "PackageError", "read_manifest", "verify_package"]
