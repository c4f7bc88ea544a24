"""Elastify device SDK: pull, verify and run elastic model packages. Depends on torch,
safetensors, tokenizers, numpy and cryptography only; never on the service packages."""

import importlib
import os

# Idle OpenMP threads sleep instead of spinning. A device is shared with other programs, and
# a spinning worker there steals the core the decode loop needs: on a busy 2-core machine
# this took SmolLM2 int8 decode from ~40-300 ms to 17 ms a token. Only takes effect when
# this package is imported before torch; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The public names are loaded on first use (PEP 562), so that `device_sdk.format`, which the
# API and the control plane read manifests with, can be imported without importing torch.
_EXPORTS = {
    "FORMAT_VERSION": "device_sdk.format",
    "Manifest": "device_sdk.format",
    "PackageError": "device_sdk.format",
    "read_manifest": "device_sdk.format",
    "TrustStore": "device_sdk.trust",
    "verify_package": "device_sdk.trust",
    "ElasticLinear": "device_sdk.elastic",
    "SLO": "device_sdk.latency",
    "pull": "device_sdk.registry",
    "ElasticModel": "device_sdk.runtime",
    "Generation": "device_sdk.runtime",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'device_sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


__all__ = [
    "FORMAT_VERSION",
    "SLO",
    "ElasticLinear",
    "ElasticModel",
    "Generation",
    "Manifest",
    "PackageError",
    "TrustStore",
    "pull",
    "read_manifest",
    "verify_package",
]
