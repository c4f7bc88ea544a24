"""`elastify-device`: verify a package on this device."""

from __future__ import annotations

import argparse
import sys

from device_sdk.package import PackageError, verify_package


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastify-device")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="check every file's sha256 (and the signature with --public-key)")
    verify.add_argument("package")
    verify.add_argument("--public-key", help="base64 Ed25519 public key to pin")
    args = parser.parse_args(argv)
    try:
        manifest = verify_package(args.package, args.public_key)
    except PackageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"ok: {manifest.name} {manifest.version}, {len(manifest.files)} files verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
