"""The trust store: publisher keys pinned by package name, and the rule every signature check follows.

TUF-style, a device trusts a key for the names it was pinned for, not for everything: the
store maps each package name to one base64 Ed25519 public key,

    {"format": 1, "keys": {"smollm2": "WvpTi+LjjCNCr/+dZ53ItQ0ZLWWsGHsuotEJKDS4CQE=", ...}}

kept in `$ELASTIFY_TRUST_STORE`, else `$XDG_CONFIG_HOME/elastify/trust.json` (default
`~/.config/elastify/trust.json`), and edited with `elastify-device trust add|list|remove`.

The rule (`check_signature`), used by pull, load and verify:
- the key is the one passed, else the one pinned for the manifest's name; a passed key that is
  not the pinned one is refused (changing a pin is `trust add --replace`, never a side effect);
- with a key, the manifest must carry a valid signature by it;
- with no key, or for an unsigned manifest, the package is refused, unless the caller opted in
  with `allow_unsigned`: then it is accepted with a logged warning (file hashes still count,
  but anyone who can write the package can recompute them). A manifest that carries a
  signature is still checked against a known key even then, so a forged one is never accepted.
Nothing is pinned on first use: a key is only ever added by `trust add` (or `TrustStore.add`).
`verify_package` is the rule and the file hashes together, for a package directory.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from device_sdk.format import (
    SAFE_NAME,
    Manifest,
    PackageError,
    atomic_write_bytes,
    check_files,
    load_public_key,
    public_key_b64,
    read_manifest,
    verify_signature,
)

TRUST_STORE_ENV = "ELASTIFY_TRUST_STORE"
STORE_FORMAT = 1
log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()  # (name, version) already warned about in this process


def default_trust_path() -> Path:
    explicit = os.environ.get(TRUST_STORE_ENV)
    if explicit:
        return Path(explicit)
    config = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config) / "elastify" / "trust.json"


class TrustStore:
    """Package name -> pinned base64 Ed25519 public key, read from and written to one JSON file."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else default_trust_path()
        self.keys = self._read()

    def _read(self) -> dict[str, str]:
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as err:
            raise PackageError(f"the trust store {self.path} cannot be read: {err}") from None
        if not isinstance(data, dict) or data.get("format") != STORE_FORMAT or not isinstance(data.get("keys"), dict):
            raise PackageError(f"the trust store {self.path} is not a format-{STORE_FORMAT} trust store")
        for name, key in data["keys"].items():
            if not isinstance(key, str):
                raise PackageError(f"the trust store {self.path} has a malformed key for {name!r}")
            load_public_key(key)  # a damaged pin fails here, with the store's name, not at some later load
        return dict(data["keys"])

    def pinned(self, name: str) -> str | None:
        return self.keys.get(name)

    def add(self, name: str, public_key, *, replace: bool = False) -> str:
        """Pin `public_key` for `name`; an existing different pin is only replaced with `replace`."""
        if not SAFE_NAME.fullmatch(name) or name in (".", ".."):
            raise PackageError(f"package name {name!r} may use only letters, digits, '.', '_' and '-'")
        key = public_key_b64(public_key)
        current = self.keys.get(name)
        if current is not None and current != key and not replace:
            raise PackageError(f"{name!r} is already pinned to another key ({current}); "
                               "replace a pin only when the publisher rotated its key (--replace)")
        self.keys[name] = key
        self._write()
        return key

    def remove(self, name: str) -> None:
        if self.keys.pop(name, None) is None:
            raise PackageError(f"no key is pinned for {name!r} in {self.path}")
        self._write()

    def _write(self) -> None:
        content = json.dumps({"format": STORE_FORMAT, "keys": dict(sorted(self.keys.items()))}, indent=2) + "\n"
        atomic_write_bytes(self.path, content.encode())  # a private temp file renamed over the store


def signing_key(name: str, public_key=None, *, store: TrustStore | None = None):
    """The key a package named `name` must be signed by: the one passed, else the pinned one, else None.

    A passed key that differs from the pinned one is refused: a pin is changed on purpose, by
    `trust add --replace`, and never by whoever hands a key to a call.
    """
    store = store if store is not None else TrustStore()
    pinned = store.pinned(name)
    if public_key is None:
        return None if pinned is None else load_public_key(pinned)
    key = load_public_key(public_key)
    if pinned is not None and public_key_b64(key) != public_key_b64(pinned):
        raise PackageError(f"the key given for {name!r} is not the key pinned for it in {store.path}; "
                           f"if the publisher rotated its key, `elastify-device trust add {name} KEY --replace`")
    return key


def check_signature(manifest: Manifest, public_key=None, *, allow_unsigned: bool = False,
                    store: TrustStore | None = None):
    """Apply the module's rule to a manifest; return the key it verified against (None: unverified, opted in)."""
    key = signing_key(manifest.name, public_key, store=store)
    if key is not None and (manifest.signature or not allow_unsigned):
        verify_signature(manifest, key)
        return key
    if not allow_unsigned:
        raise PackageError(
            f"no public key is pinned for package {manifest.name!r}, so its signature cannot be checked: pass the "
            f"publisher's key (--public-key), pin it once with `elastify-device trust add {manifest.name} KEY`, or "
            "accept an unverified package explicitly (allow_unsigned=True / --allow-unsigned)"
        )
    if (manifest.name, manifest.version) not in _warned:
        _warned.add((manifest.name, manifest.version))
        why = "its manifest is not signed" if key is not None else "no key is given or pinned for it"
        log.warning("package %s %s is used WITHOUT a signature check (allow_unsigned; %s): its file hashes are "
                    "checked, but anyone who can write the package can recompute them", manifest.name,
                    manifest.version, why)
    return None


def verify_package(package_dir: Path, public_key=None, *, files: Iterable[str] | None = None,
                   allow_unsigned: bool = False) -> Manifest:
    """Check the signature and every listed file's size and sha256.

    The signature is checked with `public_key`, else with the key pinned for the package's name
    in the trust store; without either, or for an unsigned manifest, the package is refused
    unless `allow_unsigned` (then only the hashes are checked, with a warning).
    """
    package_dir = Path(package_dir)
    manifest = read_manifest(package_dir)
    check_signature(manifest, public_key, allow_unsigned=allow_unsigned)
    check_files(package_dir, manifest, files)
    return manifest
