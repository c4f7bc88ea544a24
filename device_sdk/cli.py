"""`elastify-device`: pin publisher keys, pull, verify, profile, run and serve packages on this device."""

from __future__ import annotations

import argparse
import contextlib
import sys
import urllib.error
from pathlib import Path

from device_sdk.client import ElastifyAPIError, reason
from device_sdk.format import PackageError, load_public_key, read_manifest
from device_sdk.registry import pull, read_local_state, verify_local
from device_sdk.trust import TrustStore, check_signature

# The commands that run a model import torch and the runtime when they run, so that verify, trust,
# pull and --help start without them (torch alone takes seconds to import).


def _public_key(text: str):
    """argparse type of --public-key: a malformed key is a usage error (exit 2) that says what a key is."""
    try:
        return load_public_key(text)
    except PackageError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _drift_quantile(text: str) -> float | None:
    """argparse type of --drift-quantile: a quantile in (0, 1], or "off" (the profile as measured)."""
    if text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a quantile in (0, 1] or 'off', got {text!r}")
    return value


def _drift_headroom(text: str) -> float:
    """argparse type of --drift-headroom: a margin of at least 1."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"expected a margin of at least 1 (1.04: 4%), got {text!r}")
    return value


def _slo(args):
    from device_sdk.latency import SLO  # lazy: torch, kept off verify/trust/pull

    if args.ttft_fraction or args.tpot_fraction:
        return SLO.fraction(args.ttft_fraction, args.tpot_fraction)
    if args.ttft_ms or args.tpot_ms:
        return SLO(args.ttft_ms, args.tpot_ms)
    return None


def cmd_verify(args) -> int:
    manifest = read_manifest(args.package)
    key = check_signature(manifest, args.public_key, allow_unsigned=args.allow_unsigned)
    verify_local(args.package, args.public_key, allow_unsigned=args.allow_unsigned)  # a partial pull: what it holds
    state = read_local_state(args.package) or {}
    held = "" if state.get("max_level") is None else f" (a partial copy: levels <= {state['max_level']})"
    signature = "signature verified" if key is not None else "signature NOT checked (--allow-unsigned)"
    print(f"ok: {manifest.name} {manifest.version}{held}, files verified, {signature}")
    return 0


def cmd_trust_add(args) -> int:
    store = TrustStore()
    key = store.add(args.name, args.key, replace=args.replace)
    print(f"pinned {key} for {args.name} in {store.path}")
    return 0


def cmd_trust_list(args) -> int:
    store = TrustStore()
    for name, key in sorted(store.keys.items()):
        print(f"{name}\t{key}")
    if not store.keys:
        print(f"no keys pinned in {store.path}", file=sys.stderr)
    return 0


def cmd_trust_remove(args) -> int:
    store = TrustStore()
    store.remove(args.name)
    print(f"removed the key pinned for {args.name} from {store.path}")
    return 0


@contextlib.contextmanager
def download_bar(label: str):
    """Yield an on_progress(done, total) drawing a byte progress bar on stderr; None when stderr is not a
    terminal (a pipe, a log file, CI), where a bar would only be noise."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                   console=Console(file=sys.stderr, force_terminal=True))
    task = bar.add_task("download", total=None)
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total)


def cmd_pull(args) -> int:
    try:
        with download_bar(f"{args.name} {args.version}") as on_progress:
            path = pull(args.name, args.version, registry=args.registry, public_key=args.public_key,
                        max_level=args.max_level, cache_dir=args.cache_dir, on_progress=on_progress)
    except urllib.error.HTTPError as err:  # a bucket registry's own error
        print(f"error: the registry answered {err.code} {err.reason} for {err.url}", file=sys.stderr)
        return 1
    except urllib.error.URLError as err:
        print(f"error: cannot reach the registry at {args.registry}: {reason(err.reason)}", file=sys.stderr)
        return 1
    state = read_local_state(path)
    held = "every level" if state["max_level"] is None else f"levels <= {state['max_level']}"
    print(f"ok: {args.name} {state['version']} ({held}, {state['bytes']:,} bytes) at {path}")
    return 0


def cmd_profile(args) -> int:
    from device_sdk.latency import profile_path  # lazy: torch, kept off verify/trust/pull
    from device_sdk.measure import measure_profile  # lazy: torch, kept off verify/trust/pull
    from device_sdk.runtime import ElasticModel  # lazy: torch, kept off verify/trust/pull

    model = ElasticModel.load(args.package, public_key=args.public_key, allow_unsigned=args.allow_unsigned,
                              quantize=args.quantize)
    profile = measure_profile(model, prompt_lengths=tuple(args.prompt_lengths), decode_tokens=args.decode_tokens)
    path = profile_path(model.package_dir, model.weight_format)
    profile.save(path)
    print(f"{'level':>6} {'TTFT base ms':>13} {'ms/prompt tok':>14} {'TPOT ms':>8}")
    for name, entry in profile.levels.items():
        print(f"{name:>6} {entry.ttft_base_ms:13.2f} {entry.ttft_per_token_ms:14.3f} {entry.tpot_ms:8.2f}")
    print(f"saved {path}")
    return 0


def cmd_generate(args) -> int:
    from device_sdk.runtime import ElasticModel, Sampling  # lazy: torch, kept off verify/trust/pull

    if not args.prompt.endswith(args.keep):
        print("error: --keep must be the end of the prompt", file=sys.stderr)
        return 2
    if not 0 <= args.min_new_tokens <= args.max_new_tokens:
        print("error: --min-new-tokens must be in 0..--max-new-tokens", file=sys.stderr)
        return 2
    try:
        sampling = Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                            presence_penalty=args.presence_penalty)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = ElasticModel.load(args.package, public_key=args.public_key, allow_unsigned=args.allow_unsigned,
                              quantize=args.quantize)
    stream = model.generate(args.prompt, slo=_slo(args), max_new_tokens=args.max_new_tokens, stream=True,
                            level=args.level, keep=args.keep, min_new_tokens=args.min_new_tokens, sampling=sampling)
    for piece in stream:
        print(piece, end="", flush=True)
    result = stream.result
    tpot = "-" if result.tpot_ms is None else f"{result.tpot_ms:.1f}"
    ratio = result.decision.prompt_ratio if result.decision else 1.0
    print(f"\n[level {result.level}, prompt ratio {ratio}, TTFT {result.ttft_ms:.1f} ms, TPOT {tpot} ms, "
          f"slo_met={result.slo_met}]",
          file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from device_sdk.latency import SERVING_HEADROOM, Drift  # lazy: torch, kept off verify/trust/pull
    from device_sdk.runtime import ElasticModel  # lazy: torch, kept off verify/trust/pull
    from device_sdk.serve import make_server  # lazy: torch, kept off verify/trust/pull

    model = ElasticModel.load(args.package, public_key=args.public_key, allow_unsigned=args.allow_unsigned,
                              quantize=args.quantize)
    if (args.drift_quantile, args.drift_headroom) != (Drift.quantile, SERVING_HEADROOM):
        # reads (or measures) the profile now rather than at the first SLO
        model.latency_profile.drift = Drift(quantile=args.drift_quantile, headroom=args.drift_headroom)
    server = make_server(model, args.host, args.port, args.max_queue)
    base = f"http://{args.host}:{server.server_address[1]}/v1"
    chat = f" and {base}/chat/completions" if server.service.chat_template else " (no chat template in the package)"
    print(f"serving {model.manifest.name} {model.manifest.version} on {base}/completions{chat}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def cmd_export(args) -> int:
    verify_local(args.package, args.public_key, allow_unsigned=args.allow_unsigned)
    which = {"level": args.level, "profile": args.profile}
    if args.format != "peft" and (args.level is None) == (args.profile is None):
        print("error: give --level or --profile", file=sys.stderr)
        return 2
    try:
        if args.format == "peft":
            from device_sdk.export import export_peft_adapters  # lazy: torch, kept off verify/trust/pull

            written = export_peft_adapters(args.package, args.out, force=args.force)
            print(f"ok: peft adapters of levels {', '.join(written) or 'none (the package has no recovery adapters)'} "
                  f"in {args.out}")
            return 0
        if args.format == "gguf":
            from device_sdk.export_gguf import export_gguf  # lazy: torch, kept off verify/trust/pull

            out = export_gguf(args.package, args.out, dtype=args.type or "f16", force=args.force, **which)
        else:
            from device_sdk.export import export_hf  # lazy: torch, kept off verify/trust/pull

            out = export_hf(args.package, args.out, dtype=args.type or "f32", merge=not args.unmerged,
                            force=args.force, **which)
    except OSError as err:  # a read-only or full disk, a path that cannot be made: nothing was left behind
        print(f"error: cannot write the export at {args.out}: {err.strerror or err}"
              f"{f' ({err.filename})' if err.filename else ''}", file=sys.stderr)
        return 1
    print(f"ok: {args.format} export at {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastify-device")
    sub = parser.add_subparsers(dest="command", required=True)

    def package_command(name: str, help: str, handler):
        command = sub.add_parser(name, help=help)
        command.add_argument("package", type=Path)
        command.add_argument("--public-key", type=_public_key,
                             help="the publisher's base64 Ed25519 public key (default: the one pinned for the "
                                  "package's name with `trust add`)")
        command.add_argument("--allow-unsigned", action="store_true",
                             help="accept a package whose signature cannot be checked (no key given or pinned, or "
                                  "an unsigned manifest), with a warning")
        command.set_defaults(handler=handler)
        return command

    package_command("verify", "check the signature and every file's sha256", cmd_verify)

    pull = sub.add_parser("pull", help="download, verify and install a package")
    pull.add_argument("name")
    pull.add_argument("version", help="a version or an alias such as latest")
    pull.add_argument("--registry", required=True,
                      help="directory, file:// or http(s):// bucket URL, or the Elastify API: http(s)://HOST:PORT/v1 "
                           "(bearer token from ELASTIFY_TOKEN)")
    pull.add_argument("--public-key", type=_public_key,
                      help="the publisher's base64 Ed25519 public key (default: the one pinned for NAME)")
    pull.add_argument("--max-level", help="fetch only what levels up to this one need")
    pull.add_argument("--cache-dir", type=Path)
    pull.set_defaults(handler=cmd_pull)

    trust = sub.add_parser("trust", help="pin publisher keys by package name (pull, load and verify check them)")
    trust_sub = trust.add_subparsers(dest="trust_command", required=True)
    trust_add = trust_sub.add_parser("add", help="pin KEY for packages named NAME")
    trust_add.add_argument("name")
    trust_add.add_argument("key", type=_public_key, help="the publisher's base64 Ed25519 public key")
    trust_add.add_argument("--replace", action="store_true", help="replace another key pinned for NAME (a rotation)")
    trust_add.set_defaults(handler=cmd_trust_add)
    trust_sub.add_parser("list", help="the pinned keys").set_defaults(handler=cmd_trust_list)
    trust_remove = trust_sub.add_parser("remove", help="unpin NAME's key")
    trust_remove.add_argument("name")
    trust_remove.set_defaults(handler=cmd_trust_remove)

    for name, help, handler in (
        ("profile", "measure this device's per-level TTFT and TPOT; saved beside the package", cmd_profile),
        ("generate", "generate once, streaming to stdout", cmd_generate),
        ("serve", "OpenAI-compatible /v1/completions and /v1/chat/completions, with an slo field", cmd_serve),
    ):
        command = package_command(name, help, handler)
        command.add_argument("--quantize", choices=("int8", "int4", "fp16"), help="weight format at load")
    commands = sub.choices
    commands["profile"].add_argument("--prompt-lengths", type=int, nargs="+", default=[32, 128, 512, 1024])
    commands["profile"].add_argument("--decode-tokens", type=int, default=16)
    generate = commands["generate"]
    generate.add_argument("prompt")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--min-new-tokens", type=int, default=1,
                          help="tokens before the end-of-sequence token may come (0: the model may answer nothing)")
    generate.add_argument("--level", help="force a level instead of choosing by SLO")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    generate.add_argument("--seed", type=int, help="the same seed gives the same sampled tokens")
    generate.add_argument("--repetition-penalty", type=float, default=1.0,
                          help="divide the logits of tokens already in the prompt or output (>1 discourages loops)")
    generate.add_argument("--frequency-penalty", type=float, default=0.0,
                          help="OpenAI's: subtract this times how often a token came in the output")
    generate.add_argument("--presence-penalty", type=float, default=0.0,
                          help="OpenAI's: subtract this from every token that came in the output")
    generate.add_argument("--keep", default="", metavar="TEXT",
                          help="the end of the prompt that compression keeps whole (e.g. the question after a passage)")
    for option in ("--ttft-ms", "--tpot-ms", "--ttft-fraction", "--tpot-fraction"):
        generate.add_argument(option, type=float)
    serve = commands["serve"]
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-queue", type=int, default=4, help="waiting requests beyond which clients get 503")
    serve.add_argument("--drift-quantile", type=_drift_quantile, default=0.9,
                       help="SLO decisions scale the profile's predictions by this quantile of the recent measured ÷ "
                            "predicted ratios of served requests; 'off': the profile as measured")
    serve.add_argument("--drift-headroom", type=_drift_headroom, default=1.04,
                       help="and by this margin on top, so that cells at an SLO's boundary are not chosen; 1: none")

    export = package_command("export", "write one level (or CLONE profile), its recovery LoRA merged in, as a GGUF "
                                       "file (llama.cpp) or a transformers directory; or every level's peft adapter",
                             cmd_export)
    export.add_argument("--format", choices=("gguf", "hf", "peft"), required=True)
    export.add_argument("--level", help="the level to export")
    export.add_argument("--profile", help="a CLONE profile to export instead of a level (no LoRA)")
    export.add_argument("--type", choices=("f32", "f16", "bf16", "q8_0"),
                        help="weights: gguf f16 (default), q8_0 or f32; hf f32 (default), f16 or bf16")
    export.add_argument("--unmerged", action="store_true",
                        help="hf: leave the LoRA out of the weights and write it as a peft adapter in OUT/peft")
    export.add_argument("--out", type=Path, required=True,
                        help="the .gguf file or the directory to write: new or empty (a directory that holds "
                             "anything else is refused)")
    export.add_argument("--force", action="store_true",
                        help="replace an earlier export of the same format at --out (never anything else, "
                             "never a package)")

    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (PackageError, ConnectionError) as err:  # ConnectionError: a download that may be resumed by pulling again
        print(f"error: {err}", file=sys.stderr)
        return 1
    except ElastifyAPIError as err:
        print(f"error: {err.describe()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
