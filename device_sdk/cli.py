"""`elastify-device`: pin publisher keys, pull, verify, profile, run, serve and export packages on this device.

One Typer app in the style of `elastify`. Exit codes: 0 success, 1 a failure (a bad package, an
unreachable registry), 2 a usage error; every error is one `error: ...` line on stderr.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import urllib.error
from enum import StrEnum
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Any

import typer

from device_sdk.client import ElastifyAPIError, reason
from device_sdk.format import PackageError, load_public_key, read_manifest
from device_sdk.registry import pull as registry_pull
from device_sdk.registry import read_local_state, verify_local
from device_sdk.trust import TrustStore, check_signature

# The commands that run a model import torch and the runtime when they run, so that verify, trust,
# pull and --help start without them (torch alone takes seconds to import).

PROG = "elastify-device"


class Failure(Exception):
    """A command that could not do its work (exit 1); the message is the whole error line."""


class Usage(Exception):
    """Options that do not fit together or a bad input (exit 2); the message is the whole error line."""


def _public_key(text: str):
    """Parser of --public-key: a malformed key is a usage error (exit 2) that says what a key is."""
    try:
        return load_public_key(text)
    except PackageError as err:
        raise typer.BadParameter(str(err)) from None


def _drift_quantile(text: str) -> float | None:
    """Parser of --drift-quantile: a quantile in (0, 1], or "off" (the profile as measured)."""
    if text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise typer.BadParameter(f"expected a quantile in (0, 1] or 'off', got {text!r}")
    return value


def _drift_headroom(text: str) -> float:
    """Parser of --drift-headroom: a margin of at least 1."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value >= 1.0:
        raise typer.BadParameter(f"expected a margin of at least 1 (1.04: 4%), got {text!r}")
    return value


def _prompt_lengths(text: str) -> list[int]:
    """Parser of --prompt-lengths: positive token counts, comma-separated (`4,12`)."""
    try:
        lengths = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise typer.BadParameter(f"expected positive token counts such as 32,128, got {text!r}")
    return lengths


def _check_slo(value: float | None) -> float | None:
    """Callback of the SLO flags: finite and non-negative (nan and inf parse as floats)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise typer.BadParameter(f"must be a finite number >= 0, got {value}")
    return value


def _version(value: bool) -> None:
    if value:
        try:
            print(f"{PROG} {version(PROG)}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            print(f"{PROG} (not installed: no version)")
        raise typer.Exit()


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


class _OncePerLevel(logging.Filter):
    """Let the runtime's "level X is marked unusable" warning through once per level in this process:
    a server forced to such a level would otherwise repeat it on every request."""

    def __init__(self) -> None:
        super().__init__()
        self.warned: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if "marked unusable" not in str(record.msg) or not record.args:
            return True
        level = str(record.args[0])
        if level in self.warned:
            return False
        self.warned.add(level)
        return True


UNUSABLE_LEVEL_WARNING_ONCE = _OncePerLevel()
logging.getLogger("device_sdk.runtime").addFilter(UNUSABLE_LEVEL_WARNING_ONCE)


app = typer.Typer(name=PROG, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Pin publisher keys, pull, verify, profile, run, serve and export Elastify packages.")
trust_app = typer.Typer(no_args_is_help=True,
                        help="Pin publisher keys by package name (pull, load and verify check them).")
app.add_typer(trust_app, name="trust")


@app.callback()
def _root(
    show_version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="print the version and exit")] = False,
) -> None:
    """Pin publisher keys, pull, verify, profile, run, serve and export Elastify packages."""


Package = Annotated[Path, typer.Argument(help="the package directory (as `pull` installed it)", show_default=False)]
PublicKey = Annotated[Any, typer.Option("--public-key", parser=_public_key, metavar="KEY", show_default=False,
                                        help="the publisher's base64 Ed25519 public key (default: the one "
                                             "pinned for the package's name with `trust add`)")]
AllowUnsigned = Annotated[bool, typer.Option(
    "--allow-unsigned", help="accept a package whose signature cannot be checked (no key given or pinned, or an "
                             "unsigned manifest), with a warning")]
AsJSON = Annotated[bool, typer.Option("--json", help="print the result as JSON on stdout instead of text")]
class Quantization(StrEnum):
    int8 = "int8"
    int4 = "int4"
    fp16 = "fp16"


class ExportFormat(StrEnum):
    gguf = "gguf"
    hf = "hf"
    peft = "peft"


class WeightType(StrEnum):
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    q8_0 = "q8_0"


Quantize = Annotated[Quantization | None, typer.Option(
    "--quantize", show_default=False,
    help="weight format at load (default: the package's own)")]


def _load(package: Path, public_key, allow_unsigned: bool, quantize: str | None):
    from device_sdk.runtime import ElasticModel  # lazy: torch, kept off verify/trust/pull

    return ElasticModel.load(package, public_key=public_key, allow_unsigned=allow_unsigned,
                             quantize=None if quantize is None else quantize.value)


def _usage(message: str) -> Usage:
    return Usage(message)


@app.command("verify")
def verify_command(package: Package, public_key: PublicKey = None, allow_unsigned: AllowUnsigned = False,
                   as_json: AsJSON = False) -> None:
    """Check the signature and every file's sha256 (a partial pull: the files it holds)."""
    manifest = read_manifest(package)
    key = check_signature(manifest, public_key, allow_unsigned=allow_unsigned)
    verify_local(package, public_key, allow_unsigned=allow_unsigned)
    max_level = (read_local_state(package) or {}).get("max_level")
    if as_json:
        _print_json({"name": manifest.name, "version": manifest.version, "max_level": max_level,
                     "files_verified": True, "signature_verified": key is not None})
        return
    held = "" if max_level is None else f" (a partial copy: levels <= {max_level})"
    signature = "signature verified" if key is not None else "signature NOT checked (--allow-unsigned)"
    print(f"ok: {manifest.name} {manifest.version}{held}, files verified, {signature}")


@trust_app.command("add")
def trust_add_command(
    name: Annotated[str, typer.Argument(help="the package name the key is pinned for")],
    key: Annotated[Any, typer.Argument(parser=_public_key, metavar="KEY",
                                       help="the publisher's base64 Ed25519 public key")],
    replace: Annotated[bool, typer.Option("--replace", help="replace another key pinned for NAME (a rotation)")]
    = False,
) -> None:
    """Pin KEY for packages named NAME."""
    store = TrustStore()
    pinned = store.add(name, key, replace=replace)
    print(f"pinned {pinned} for {name} in {store.path}")


@trust_app.command("list")
def trust_list_command(as_json: AsJSON = False) -> None:
    """The pinned keys, one `NAME<tab>KEY` a line."""
    store = TrustStore()
    if as_json:
        _print_json(dict(sorted(store.keys.items())))
        return
    for name, key in sorted(store.keys.items()):
        print(f"{name}\t{key}")
    if not store.keys:
        print(f"no keys pinned in {store.path}", file=sys.stderr)


@trust_app.command("remove")
def trust_remove_command(name: Annotated[str, typer.Argument(help="the package name to unpin")]) -> None:
    """Unpin NAME's key."""
    store = TrustStore()
    store.remove(name)
    print(f"removed the key pinned for {name} from {store.path}")


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


@app.command("pull")
def pull_command(
    name: Annotated[str, typer.Argument(help="the package name")],
    package_version: Annotated[str, typer.Argument(metavar="VERSION", help="a version or an alias such as latest")],
    registry: Annotated[str, typer.Option(
        "--registry", show_default=False,
        help="directory, file:// or http(s):// bucket URL, or the Elastify API: http(s)://HOST:PORT/v1 "
             "(bearer token from ELASTIFY_TOKEN)")],
    public_key: Annotated[Any, typer.Option("--public-key", parser=_public_key, metavar="KEY", show_default=False,
                                            help="the publisher's base64 Ed25519 public key (default: the one "
                                                 "pinned for NAME)")] = None,
    max_level: Annotated[str | None, typer.Option("--max-level", show_default="every level",
                                                  help="fetch only what levels up to this one need")] = None,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", show_default="~/.cache/elastify",
                                                   help="where packages are installed")] = None,
    precision: Annotated[str | None, typer.Option(
        "--precision", show_default="the package's own",
        help="fetch only this precision's weight file (e.g. q8_0, q4_0) when the package has one")] = None,
    allow_downgrade: Annotated[bool, typer.Option(
        "--allow-downgrade", help="accept a manifest older than the one installed (a rollback)")] = False,
    as_json: AsJSON = False,
) -> None:
    """Download, verify and install a package."""
    # passed only when given, so that a registry.pull without them is still called correctly
    extra: dict[str, Any] = {}
    if precision is not None:
        extra["precision"] = precision
    if allow_downgrade:
        extra["allow_downgrade"] = True
    try:
        with download_bar(f"{name} {package_version}") as on_progress:
            path = registry_pull(name, package_version, registry=registry, public_key=public_key,
                                 max_level=max_level, cache_dir=cache_dir, on_progress=on_progress, **extra)
    except urllib.error.HTTPError as err:  # a bucket registry's own error
        raise Failure(f"the registry answered {err.code} {err.reason} for {err.url}") from None
    except urllib.error.URLError as err:
        raise Failure(f"cannot reach the registry at {registry}: {reason(err.reason)}") from None
    state = read_local_state(path)
    if as_json:
        _print_json({"name": name, "version": state["version"], "max_level": state["max_level"],
                     "bytes": state["bytes"], "path": str(path)})
        return
    held = "every level" if state["max_level"] is None else f"levels <= {state['max_level']}"
    print(f"ok: {name} {state['version']} ({held}, {state['bytes']:,} bytes) at {path}")


@app.command("profile")
def profile_command(
    package: Package, public_key: PublicKey = None, allow_unsigned: AllowUnsigned = False,
    quantize: Quantize = None,
    prompt_lengths: Annotated[Any, typer.Option(
        "--prompt-lengths", parser=_prompt_lengths, metavar="N,N,...",
        help="prompt lengths (tokens) to time prefill at, comma-separated")] = "32,128,512,1024",
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", min=1,
                                               help="tokens decoded to time TPOT")] = 16,
    as_json: AsJSON = False,
) -> None:
    """Measure this device's per-level TTFT and TPOT; saved beside the package."""
    from device_sdk.latency import profile_path  # lazy: torch, kept off verify/trust/pull
    from device_sdk.measure import measure_profile  # lazy: torch, kept off verify/trust/pull

    model = _load(package, public_key, allow_unsigned, quantize)
    profile = measure_profile(model, prompt_lengths=tuple(prompt_lengths), decode_tokens=decode_tokens)
    path = profile_path(model.package_dir, model.weight_format)
    profile.save(path)
    if as_json:
        _print_json({"path": str(path), "levels": {
            name: {"ttft_base_ms": entry.ttft_base_ms, "ttft_per_token_ms": entry.ttft_per_token_ms,
                   "tpot_ms": entry.tpot_ms} for name, entry in profile.levels.items()}})
        return
    print(f"{'level':>6} {'TTFT base ms':>13} {'ms/prompt tok':>14} {'TPOT ms':>8}")
    for name, entry in profile.levels.items():
        print(f"{name:>6} {entry.ttft_base_ms:13.2f} {entry.ttft_per_token_ms:14.3f} {entry.tpot_ms:8.2f}")
    print(f"saved {path}")


def _slo_option(flag: str, help: str):
    return Annotated[float | None, typer.Option(flag, callback=_check_slo, show_default="none", help=help)]


FRACTION_NOTE = "a fraction of the full model's latency on this prompt (0.5: half of it), as profiled on this device"


def _slo(ttft_ms, tpot_ms, ttft_fraction, tpot_fraction):
    """The SLO the flags give, or None; an SLO is in milliseconds or in fractions, not both."""
    if (ttft_ms is not None and ttft_fraction is not None) or (tpot_ms is not None and tpot_fraction is not None):
        which = "--ttft-ms and --ttft-fraction" if ttft_fraction is not None and ttft_ms is not None \
            else "--tpot-ms and --tpot-fraction"
        raise _usage(f"{which} contradict each other: give one")
    absolute = ttft_ms is not None or tpot_ms is not None
    relative = ttft_fraction is not None or tpot_fraction is not None
    if absolute and relative:
        raise _usage("give the SLO in milliseconds (--ttft-ms, --tpot-ms) or as fractions (--ttft-fraction, "
                     "--tpot-fraction), not both")
    if not (absolute or relative):
        return None
    from device_sdk.latency import SLO  # lazy: torch, kept off verify/trust/pull

    return SLO.fraction(ttft_fraction, tpot_fraction) if relative else SLO(ttft_ms, tpot_ms)


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise _usage("give PROMPT or --prompt-file, not both")
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except OSError as err:
            raise Failure(f"cannot read --prompt-file {prompt_file}: {err.strerror or err}") from None
    elif prompt == "-":
        text = sys.stdin.read()
    elif prompt is None:
        raise _usage("give a PROMPT, - to read it from stdin, or --prompt-file PATH")
    else:
        text = prompt
    if not text.strip():
        raise _usage("the prompt is empty")
    return text


@app.command("generate")
def generate_command(
    package: Package,
    prompt: Annotated[str | None, typer.Argument(help="the prompt; - reads it from stdin", show_default=False)]
    = None,
    public_key: PublicKey = None, allow_unsigned: AllowUnsigned = False, quantize: Quantize = None,
    prompt_file: Annotated[Path | None, typer.Option("--prompt-file", metavar="PATH", show_default=False,
                                                     help="read the prompt from this file (UTF-8)")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="most tokens to generate")] = 64,
    min_new_tokens: Annotated[int, typer.Option(
        "--min-new-tokens", min=0,
        help="tokens before the end-of-sequence token may come (0: the model may answer nothing)")] = 1,
    level: Annotated[str | None, typer.Option("--level", show_default="chosen by the SLO, else the largest",
                                              help="force a level (e.g. 0.5) instead of choosing by SLO")] = None,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0 is greedy")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="nucleus sampling (with --temperature > 0)")] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed", show_default="random",
                                             help="the same seed gives the same sampled tokens")] = None,
    repetition_penalty: Annotated[float, typer.Option(
        "--repetition-penalty",
        help="divide the logits of tokens already in the prompt or output (>1 discourages loops)")] = 1.0,
    frequency_penalty: Annotated[float, typer.Option(
        "--frequency-penalty", help="OpenAI's: subtract this times how often a token came in the output")] = 0.0,
    presence_penalty: Annotated[float, typer.Option(
        "--presence-penalty", help="OpenAI's: subtract this from every token that came in the output")] = 0.0,
    keep: Annotated[str | None, typer.Option(
        "--keep", metavar="TEXT", show_default="the prompt's question",
        help="the end of the prompt that compression keeps whole (e.g. the question after a passage; by default "
             "its question: from its last 'Question:' line, else its last paragraph's last line with a '?', else "
             "its last line; '' lets all of it compress)")] = None,
    ttft_ms: _slo_option("--ttft-ms", "SLO: time to first token in milliseconds") = None,
    tpot_ms: _slo_option("--tpot-ms", "SLO: time per output token in milliseconds") = None,
    ttft_fraction: _slo_option("--ttft-fraction", f"SLO: time to first token as {FRACTION_NOTE}") = None,
    tpot_fraction: _slo_option("--tpot-fraction", f"SLO: time per output token as {FRACTION_NOTE}") = None,
    as_json: AsJSON = False,
) -> None:
    """Generate once, streaming to stdout (the level, TTFT and TPOT go to stderr)."""
    slo = _slo(ttft_ms, tpot_ms, ttft_fraction, tpot_fraction)
    if level is not None and slo is not None:
        raise _usage("--level forces a level and an SLO flag asks for one to be chosen: give one")
    text = _read_prompt(prompt, prompt_file)
    if keep is not None and not text.endswith(keep):
        raise _usage("--keep must be the end of the prompt")
    if min_new_tokens > max_new_tokens:
        raise _usage("--min-new-tokens must be in 0..--max-new-tokens")
    from device_sdk.runtime import Sampling  # lazy: torch, kept off verify/trust/pull

    try:
        sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed, repetition_penalty=repetition_penalty,
                            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
    except ValueError as err:
        raise _usage(str(err)) from None
    model = _load(package, public_key, allow_unsigned, quantize)
    if level is not None:
        try:
            model.manifest.elastic.level(level)
        except PackageError as err:
            raise _usage(f"--level: {err}") from None
    try:
        stream = model.generate(text, slo=slo, max_new_tokens=max_new_tokens, stream=True, level=level, keep=keep,
                                min_new_tokens=min_new_tokens, sampling=sampling)
        pieces = []
        for piece in stream:
            if as_json:
                pieces.append(piece)
            else:
                print(piece, end="", flush=True)
    except ValueError as err:  # e.g. a prompt that encodes to no tokens, or one longer than the context
        raise _usage(str(err)) from None
    result = stream.result
    ratio = result.decision.prompt_ratio if result.decision else 1.0
    if as_json:
        data = {"text": "".join(pieces), "level": result.level, "prompt_ratio": ratio, "ttft_ms": result.ttft_ms,
                "tpot_ms": result.tpot_ms, "prompt_tokens": result.prompt_tokens,
                "finish_reason": result.finish_reason}
        if slo is not None:
            data["slo_met"] = result.slo_met
        _print_json(data)
        return
    tpot = "-" if result.tpot_ms is None else f"{result.tpot_ms:.1f}"
    met = "" if slo is None else f", slo_met={result.slo_met}"
    print(f"\n[level {result.level}, prompt ratio {ratio}, TTFT {result.ttft_ms:.1f} ms, TPOT {tpot} ms{met}]",
          file=sys.stderr)


@app.command("serve")
def serve_command(
    package: Package, public_key: PublicKey = None, allow_unsigned: AllowUnsigned = False, quantize: Quantize = None,
    host: Annotated[str, typer.Option("--host", help="the address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="the port to listen on (0: any free one)")]
    = 8000,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1,
                                           help="waiting requests beyond which clients get 503")] = 4,
    drift_quantile: Annotated[Any, typer.Option(
        "--drift-quantile", parser=_drift_quantile, metavar="Q|off",
        help="SLO decisions scale the profile's predictions by this quantile of the recent measured ÷ predicted "
             "ratios of served requests; 'off': the profile as measured")] = "0.9",
    drift_headroom: Annotated[Any, typer.Option(
        "--drift-headroom", parser=_drift_headroom, metavar="MARGIN",
        help="and by this margin on top, so that cells at an SLO's boundary are not chosen; 1: none")] = "1.04",
    model_name: Annotated[str | None, typer.Option(
        "--model-name", show_default="the package's name",
        help="the model id clients send and /v1/models lists")] = None,
    log_requests: Annotated[bool, typer.Option("--log-requests/--no-log-requests",
                                               help="one access-log line per request")] = True,
) -> None:
    """OpenAI-compatible /v1/completions and /v1/chat/completions, with an slo field."""
    from device_sdk.latency import SERVING_HEADROOM, Drift  # lazy: torch, kept off verify/trust/pull

    model = _load(package, public_key, allow_unsigned, quantize)
    if (drift_quantile, drift_headroom) != (Drift.quantile, SERVING_HEADROOM):
        # reads (or measures) the profile now rather than at the first SLO
        model.latency_profile.drift = Drift(quantile=drift_quantile, headroom=drift_headroom)
    from device_sdk.serve import run_server  # lazy: torch and FastAPI, kept off verify/trust/pull

    run_server(model, host=host, port=port, max_queue=max_queue, model_name=model_name, log_requests=log_requests)


@app.command("export")
def export_command(
    package: Package,
    export_format: Annotated[ExportFormat, typer.Option(
        "--format", show_default=False,
        help="gguf: one file for llama.cpp; hf: a transformers directory; peft: every level's recovery adapter")],
    out: Annotated[Path, typer.Option(
        "--out", show_default=False,
        help="the .gguf file or the directory to write: new or empty (a directory that holds anything else is "
             "refused)")],
    public_key: PublicKey = None, allow_unsigned: AllowUnsigned = False,
    level: Annotated[str | None, typer.Option("--level", show_default=False,
                                              help="the level to export (gguf, hf)")] = None,
    profile: Annotated[str | None, typer.Option("--profile", show_default=False,
                                                help="a CLONE profile to export instead of a level (no LoRA)")] = None,
    weight_type: Annotated[WeightType | None, typer.Option(
        "--type", show_default="gguf f16, hf f32",
        help="weights: gguf f16, q8_0 or f32; hf f32, f16 or bf16")] = None,
    unmerged: Annotated[bool, typer.Option(
        "--unmerged", help="hf: leave the LoRA out of the weights and write it as a peft adapter in OUT/peft")]
    = False,
    force: Annotated[bool, typer.Option(
        "--force", help="replace an earlier export of the same format at --out (never anything else, never a "
                        "package)")] = False,
    as_json: AsJSON = False,
) -> None:
    """Write one level (or CLONE profile), its recovery LoRA merged in, as a GGUF file (llama.cpp) or a
    transformers directory; or every level's peft adapter."""
    export_format = export_format.value
    dtype = None if weight_type is None else weight_type.value
    if export_format != "peft" and (level is None) == (profile is None):
        raise _usage("give --level or --profile")
    verify_local(package, public_key, allow_unsigned=allow_unsigned)
    which = {"level": level, "profile": profile}
    try:
        if export_format == "peft":
            from device_sdk.export import export_peft_adapters  # lazy: torch, kept off verify/trust/pull

            written = export_peft_adapters(package, out, force=force)
            if as_json:
                _print_json({"format": "peft", "path": str(out), "levels": list(written)})
            else:
                print(f"ok: peft adapters of levels "
                      f"{', '.join(written) or 'none (the package has no recovery adapters)'} in {out}")
            return
        if export_format == "gguf":
            from device_sdk.export_gguf import export_gguf  # lazy: torch, kept off verify/trust/pull

            written_at = export_gguf(package, out, dtype=dtype or "f16", force=force, **which)
        else:
            from device_sdk.export import export_hf  # lazy: torch, kept off verify/trust/pull

            written_at = export_hf(package, out, dtype=dtype or "f32", merge=not unmerged, force=force,
                                   **which)
    except OSError as err:  # a read-only or full disk, a path that cannot be made: nothing was left behind
        raise Failure(f"cannot write the export at {out}: {err.strerror or err}"
                      f"{f' ({err.filename})' if err.filename else ''}") from None
    if as_json:
        _print_json({"format": export_format, "path": str(written_at)})
    else:
        print(f"ok: {export_format} export at {written_at}")


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on argv (default sys.argv[1:]) and return its exit code: 0, 1 (a failure) or 2 (usage)."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name=PROG, standalone_mode=False)
    except typer.TyperException as err:  # typer's own usage errors (exit_code 2): one line, then where to look
        ctx = getattr(err, "ctx", None)
        where = f" (see {ctx.command_path} --help)" if err.exit_code == 2 and ctx is not None else ""
        if err.format_message():  # empty after no_args_is_help printed the help
            _error(f"{err.format_message()}{where}")
        return err.exit_code
    except Usage as err:
        _error(str(err))
        return 2
    except typer.Abort:  # EOF at a prompt
        _error("aborted")
        return 1
    except (Failure, PackageError, ConnectionError) as err:  # ConnectionError: a download a new pull resumes
        _error(str(err))
        return 1
    except ElastifyAPIError as err:
        _error(err.describe())
        return 1
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
