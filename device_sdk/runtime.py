"""ElasticModel: load a package, switch levels without copying, generate under an SLO.

    model = ElasticModel.load(pull("smollm2", "latest", registry=..., public_key=...), quantize="int8")
    out = model.generate("The capital of France is", slo=SLO(ttft_ms=200, tpot_ms=40))
    out.text, out.level, out.ttft_ms, out.tpot_ms, out.slo_met

Weights are memory-mapped from the package (copy-on-write) and only converted when a
format other than the stored one is asked for. `set_level` / `set_widths` move views and
swap the level's LoRA (all adapters are read at load), so switching is O(layers).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from device_sdk import quant
from device_sdk.chat import ChatPrompt
from device_sdk.experts import ExpertSet
from device_sdk.format import (
    HEAD_FORMATS,
    WEIGHTS,
    CloneProfile,
    Level,
    LevelShape,
    Manifest,
    PackageError,
    check_files,
    clone_profiles,
    head_tensor,
    precision_formats,
    safetensors_layout,
    weights_ranges,
)
from device_sdk.kernels import NativeDecoder, make_linear
from device_sdk.latency import (
    SERVING_HEADROOM,
    SLO,
    Decision,
    Drift,
    LatencyProfile,
    choose_level,
    profile_path,
)
from device_sdk.llama import Projection, Transformer
from device_sdk.lora import PROJECTIONS, LoRA, projection_key, read_adapter
from device_sdk.measure import estimate_profile, measure_tlm_latency
from device_sdk.quant import BLOCK_BYTES, QUANTIZED_FORMATS, Packed, blocks_for
from device_sdk.registry import read_local_state, verify_local
from device_sdk.tlm import TLM, question_tail, tlm_decider

_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# Bytes per stored weight, by weight format (int8/int4: a 34- or 18-byte block per 32 weights, device_sdk.quant;
# an int4 model's LM head is int8, HEAD_FORMATS).
ELEMENT_SIZE = {"fp32": 4, "fp16": 2, "int8": 34 / 32, "int4": 18 / 32}
FORCE_TOKENS = ("?",)  # compression never drops a question mark (the labelling stage's default too)

log = logging.getLogger(__name__)


class PromptTooLong(ValueError):
    """The prompt has more tokens than the model's context (`max_position`); refused before prefill
    allocates anything for it (the device server answers 400)."""


def _quality_summary(shape: LevelShape) -> str:
    """The report card's verdict inputs, for a warning: `ppl_ratio:lambada 4.2, repeat_4gram_rate 0.61`."""
    shown = [f"{key} {value:g}" for key, value in sorted(shape.quality.items())
             if key.startswith(("ppl_ratio:", "repeat_4gram"))]
    return ", ".join(shown) or "no quality recorded"


def map_weights(path: Path, packed: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a view of one copy-on-write memory map; those named in `packed`
    are uint8 blocks (a precision file's quantised tensors)."""
    data_start, header = safetensors_layout(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
    tensors = {}
    for name, info in header.items():
        dtype = torch.uint8 if name in packed and info["dtype"] == "U8" else _TORCH_DTYPES.get(info["dtype"])
        if dtype is None:
            raise PackageError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = (data_start + offset for offset in info["data_offsets"])
        tensors[name] = mapped[begin:end].view(dtype).reshape(info["shape"])
    return tensors


def map_precision_weights(package_dir: Path, manifest: Manifest, precision: str) -> dict[str, torch.Tensor | Packed]:
    """A precision's weights file, memory-mapped: its quantised tensors as `Packed` blocks in the format its
    manifest entry states (the LM head Q8_0 in an int4 file), the rest as stored.

    The unpacked shapes follow from the manifest: an elastic tensor has its units' rows, the head the
    vocabulary's, and every one of these matrices has `hidden` columns (q/k/v/gate/up and the head read the
    hidden state, o/down write it); each is checked against the packed shape."""
    ranges = weights_ranges(manifest, precision)
    formats = precision_formats(manifest, precision)
    tensors = map_weights(Path(package_dir) / ranges["file"], frozenset(formats))
    arch, elastic = manifest.architecture, manifest.elastic
    for name, weight_format in formats.items():
        spec = elastic.tensors.get(name)
        if spec is not None:
            units = (elastic.attn_units if spec.unit == "attn" else elastic.mlp_units)[spec.layer]
            rows, axis = units * spec.rows_per_unit, "in" if spec.transposed else "out"
        elif name == head_tensor(arch):
            rows, axis = arch.vocab, "out"
        else:
            raise PackageError(f"{ranges['file']}: {name} is quantised but is neither an elastic tensor nor the LM head")
        size = BLOCK_BYTES[weight_format]
        expected = (rows, blocks_for(arch.hidden) * size) if axis == "out" else (blocks_for(rows), arch.hidden * size)
        if name not in tensors or tuple(tensors[name].shape) != expected:
            raise PackageError(f"{ranges['file']}: {name} should be {weight_format} blocks of shape {list(expected)}, "
                               f"not {list(tensors[name].shape) if name in tensors else 'missing'}")
        tensors[name] = Packed(tensors[name], weight_format, (rows, arch.hidden))
    return tensors


@dataclass
class Generation:
    text: str
    tokens: list[int]
    level: str
    ttft_ms: float
    tpot_ms: float | None  # None when only one token was generated
    slo_met: bool
    prompt_tokens: int
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length"
    decision: Decision = field(repr=False, default=None)
    served_prompt: str = field(repr=False, default="")  # the prompt as the model read it, after any compression


@dataclass(frozen=True)
class Sampling:
    """Sample instead of taking the argmax: softmax at `temperature`, kept to the smallest set of
    tokens whose probability reaches `top_p` (nucleus). Temperature 0 is greedy. The same `seed`
    with the same prompt and level gives the same tokens; no seed draws one from the OS.

    The penalties work at any temperature, greedy too, and with the semantics of the servers users
    already know. `repetition_penalty` (CTRL's, as in transformers and vLLM) divides the positive logit
    of every token already in the prompt or the output by it and multiplies a negative one by it.
    `frequency_penalty` and `presence_penalty` (OpenAI's) subtract, from a token's logit, that value
    times how often the token has come in the output, and that value once it has come at all.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, not {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in -2..2, not {getattr(self, name)}")

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def penalties(self, prompt_ids: Sequence[int], vocab: int) -> Penalties | None:
        """The penalties' state for one generation over `prompt_ids`; None when there are none."""
        return Penalties(self, prompt_ids, vocab) if self.penalised else None

    def picker(self) -> Callable[[torch.Tensor], int]:
        """A token chooser for one generation (it owns its random generator)."""
        if self.temperature == 0:
            return _greedy
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)

        def pick(logits: torch.Tensor) -> int:
            probs = torch.softmax(logits.float() / self.temperature, dim=-1)
            if self.top_p >= 1.0:
                return int(torch.multinomial(probs, 1, generator=generator))
            ranked, order = probs.sort(descending=True)
            ranked = ranked * ((ranked.cumsum(-1) - ranked) < self.top_p)  # the top one always stays
            return int(order[torch.multinomial(ranked, 1, generator=generator)])

        return pick


GREEDY = Sampling(temperature=0)


class Penalties:
    """One generation's repetition, frequency and presence penalties (see Sampling): which tokens the
    prompt and output hold, and how often each came in the output."""

    def __init__(self, sampling: Sampling, prompt_ids: Sequence[int], vocab: int):
        self.sampling = sampling
        self.seen = torch.zeros(vocab, dtype=torch.bool)
        self.seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
        self.counts = torch.zeros(vocab)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float().clone()
        penalty = self.sampling.repetition_penalty
        if penalty != 1.0:
            seen = logits[self.seen]
            logits[self.seen] = torch.where(seen > 0, seen / penalty, seen * penalty)
        logits -= self.sampling.frequency_penalty * self.counts + self.sampling.presence_penalty * (self.counts > 0)
        return logits

    def add(self, token: int) -> None:
        self.seen[token] = True
        self.counts[token] += 1


def _greedy(logits: torch.Tensor) -> int:
    return int(logits.argmax())


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop string (not yet shown)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class GenerationStream:
    """Iterate for text pieces as they are decoded; `.result` holds the Generation afterwards."""

    def __init__(self, steps: Iterator[str]):
        self._steps = steps
        self.result: Generation | None = None

    def __iter__(self):
        self.result = yield from self._steps


class ElasticModel:
    def __init__(self, package_dir: Path, manifest: Manifest, weights, tokenizer: Tokenizer, weight_format: str,
                 native: bool, held_level: str | None):
        self.package_dir = Path(package_dir)
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.weight_format = weight_format
        # a partial pull holds levels up to this one only
        self.held_level = None if held_level is None else Level(held_level)
        make = partial(make_linear, weight_format=weight_format, native=native)
        self.transformer = Transformer(manifest.architecture, weights, make)
        self.transformer.decoder = NativeDecoder.build(self.transformer)  # None: decode on the torch path
        # Per layer: (LoRA key, projection, sized by KV groups?), built once so a switch only loops.
        self._switch_plan = [
            [(name, proj, ".self_attn." in name) for name, proj in self._projections(block, index)]
            for index, block in enumerate(self.transformer.layers)
        ]
        # Every projection's views for every level, made once: a level switch moves one cursor.
        levels = manifest.elastic.levels
        self._level_index = {level.name: i for i, level in enumerate(levels)}
        for index, projections in enumerate(self._switch_plan):
            for _, proj, sized_by_groups in projections:
                units = [(level.attn_units if sized_by_groups else level.mlp_units)[index] for level in levels]
                proj.linear.bind_levels(self.transformer.cursor, units)
        self.adapters = self._read_adapters()
        config = json.loads((self.package_dir / "model" / "config.json").read_text())
        eos = config.get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        # With a TLM in the package it picks (prompt ratio, level) per request; else the profile rule does.
        self.tlm = TLM.load((self.package_dir / manifest.tlm["config"]).parent) if manifest.tlm else None
        self.decide = tlm_decider(self.tlm) if self.tlm else choose_level
        self.compress = self._compress if self.tlm else None
        self.level: str | None = None
        self._profile: LatencyProfile | None = None
        self.profile: str | None = None  # the CLONE profile in use, if any
        self._experts: ExpertSet | None = None  # loaded on first use
        self._mixed = False
        self.set_level(self.available_levels()[-1])

    @property
    def element_size(self) -> float:
        """Bytes per stored weight in this model's weight format: what a decode step streams per parameter."""
        return ELEMENT_SIZE[self.weight_format]

    def _compress(self, prompt: str, ratio: float) -> str:
        return self.tlm.compress(prompt, ratio, FORCE_TOKENS).text

    def _compressed(self, prompt: str | ChatPrompt, ratio: float, keep: str) -> str:
        """`prompt` with all but its `keep` end compressed; the whitespace before `keep` stays as it was.
        A chat's compressible contents are compressed one by one, then its template renders them."""
        if isinstance(prompt, ChatPrompt):
            return prompt.compressed(lambda content: self.compress(content, ratio))
        head = prompt[:len(prompt) - len(keep)]
        body = head.rstrip()
        if not body:
            return prompt
        return self.compress(body, ratio) + head[len(body):] + keep

    # -- loading -------------------------------------------------------------------------

    @classmethod
    def load(cls, package_dir: Path, *, public_key=None, allow_unsigned: bool = False, quantize: str | None = None,
             native: bool = True, verify: bool = True, precision: str | None = None) -> ElasticModel:
        """Open a local package. `quantize`: "int8", "int4" or "fp16" at load; None keeps the stored format.
        `precision` ("int8", "int4": one the manifest lists) runs that precision's own weights file instead,
        as stored; a copy pulled with a precision holds only that file and runs it without being told.
        At int4, quantised at load or from the file, the LM head is Q8_0 (`format.HEAD_FORMATS`).

        The manifest's signature is checked with `public_key`, else with the key pinned for the
        package's name (`device_sdk.trust`); a package with neither, or an unsigned one, is
        refused unless `allow_unsigned=True`, which logs a warning. `verify` (the default) also
        hashes every byte the model holds, a copy installed by `pull` included (its local record
        is not signed, so it never turns checks off; see `verify_local`); `verify=False` skips
        the hashing only, for bytes the caller has just written itself.
        """
        package_dir = Path(package_dir)
        manifest = verify_local(package_dir, public_key, full=verify, allow_unsigned=allow_unsigned)
        state = read_local_state(package_dir)
        held = state.get("max_level") if state else None
        pulled = state.get("precision") if state else None
        precision = precision or pulled
        if precision is not None:
            if quantize is not None and quantize != precision:
                raise PackageError(f"{package_dir} runs its {precision} weights file, which cannot be quantised "
                                   f"again to {quantize}")
            if verify and precision != pulled:  # verify_local hashed the weights file this copy holds, not this one
                check_files(package_dir, manifest, [weights_ranges(manifest, precision)["file"]])
            weights, weight_format = map_precision_weights(package_dir, manifest, precision), precision
        else:
            stored = next(iter(safetensors_layout(package_dir / WEIGHTS)[1].values()))["dtype"]
            weights, weight_format = map_weights(package_dir / WEIGHTS), quantize or ("fp16" if stored == "F16" else "fp32")
        head = head_tensor(manifest.architecture)
        if weight_format in QUANTIZED_FORMATS and not isinstance(weights[head], Packed):  # quantised at load here
            head_format = HEAD_FORMATS[weight_format]
            weights[head] = Packed(quant.quantize(weights[head], "out", head_format), head_format,
                                   tuple(weights[head].shape))
        tokenizer = Tokenizer.from_file(str(package_dir / "model" / "tokenizer.json"))
        return cls(package_dir, manifest, weights, tokenizer, weight_format, native, held)

    def _read_adapters(self) -> dict[str, dict[str, LoRA]]:
        """Per level: projection key -> (A [r, in_active], B [out_active, r], scale)."""
        return {level.name: read_adapter(self.package_dir / level.adapter) for level in self.manifest.elastic.levels
                if level.adapter is not None and self.holds(level.name)}

    # -- switching -----------------------------------------------------------------------

    def available_levels(self) -> list[str]:
        return [level.name for level in self.manifest.elastic.levels if self.holds(level.name)]

    def holds(self, level: Level | float | str) -> bool:
        return self.held_level is None or Level(level) <= self.held_level

    def set_level(self, level: str | float) -> None:
        """Switch to a package level and its LoRA: one cursor write for the widths, no weight data copied."""
        chosen: LevelShape = self.manifest.elastic.level(level)
        if not self.holds(chosen.name):
            raise PackageError(
                f"level {chosen.name} is above {self.held_level}, the most this partial copy holds; pull it again"
            )
        self.transformer.cursor.select(self._level_index[chosen.name])
        self._set_loras(self.adapters.get(chosen.name, {}))
        self.level = chosen.name
        self.profile = None

    def set_widths(self, attn_units: list[int], mlp_units: list[int]) -> None:
        """Any per-layer widths (e.g. a CLONE profile); no level, so no LoRA."""
        layers = self.manifest.architecture.layers
        if len(attn_units) != layers or len(mlp_units) != layers:
            raise ValueError(f"need one width per layer ({layers})")
        if self.held_level is not None:
            held = self.manifest.elastic.level(self.held_level)
            if any(a > h for a, h in zip(attn_units, held.attn_units, strict=True)) or any(
                m > h for m, h in zip(mlp_units, held.mlp_units, strict=True)
            ):
                raise PackageError(f"widths exceed level {self.held_level}, the most this partial copy holds")
        self.transformer.cursor.select(-1)  # layers run their own widths
        self._set_widths(attn_units, mlp_units, {})
        self.level = None
        self.profile = None

    def _set_widths(self, attn_units, mlp_units, lora) -> None:
        for projections, groups, neurons in zip(self._switch_plan, attn_units, mlp_units, strict=True):
            for _, proj, sized_by_groups in projections:
                width = groups if sized_by_groups else neurons
                if proj.linear.units != width:  # anchor layers never change: skip them
                    proj.linear.set_width(width)
        self._set_loras(lora)

    def _set_loras(self, lora) -> None:
        for projections in self._switch_plan:
            for name, proj, _ in projections:
                adapter = lora.get(name)
                if proj.lora is not adapter:
                    proj.__dict__["lora"] = adapter  # a plain attribute; see ElasticLinear.set_width

    @staticmethod
    def _projections(block, index: int) -> list[tuple[str, Projection]]:
        return [(projection_key(index, name), block.projection(name)) for name in PROJECTIONS]

    # -- CLONE: width profiles and LoRA-MoE experts ---------------------------------------

    def profiles(self) -> dict[str, CloneProfile]:
        return clone_profiles(self.manifest)

    def set_profile(self, name: str) -> None:
        """Switch to a named CLONE per-layer width profile (views only; profiles carry no LoRA)."""
        profiles = self.profiles()
        if name not in profiles:
            raise PackageError(f"no CLONE profile {name!r}; the package has {sorted(profiles) or 'none'}")
        self.set_widths(profiles[name].attn_units, profiles[name].mlp_units)
        self.profile = name

    def choose_profile(self, slo: SLO | None, prompt_tokens: int) -> str | None:
        """The lowest-perplexity profile whose predicted TTFT/TPOT meet `slo`; None if none does."""
        target = slo.absolute(self.latency_profile, prompt_tokens) if slo is not None else SLO()
        fitting = [(p.ppl, name) for name, p in self.profiles().items()
                   if p.ttft_ms is not None and target.met(p.ttft_ms, p.tpot_ms)]
        return min(fitting)[1] if fitting else None

    def mix_experts(self, prompt: str, mode: str = "soft") -> dict[str, float]:
        """Route `prompt` to the package's experts and mix their LoRAs onto the current widths."""
        if self._experts is None:
            self._experts = ExpertSet.load(self.package_dir, self.manifest)
        weights = self._experts.weights_for(prompt, mode)
        self._experts.apply(self._switch_plan, weights, self.adapters.get(self.level, {}) if self.level else {})
        self._mixed = True
        return weights

    def _clone_setup(self, prompt: str, slo: SLO | None, prompt_tokens: int, profile: str | None,
                     experts: str | None) -> None:
        """Per request: `profile` (a name, or "auto" for the SLO's pick) and `experts` (a routing mode)."""
        if profile == "auto":
            profile = self.choose_profile(slo, prompt_tokens)
        if profile is not None:
            self.set_profile(profile)
        elif self.profile is not None or self._mixed:
            self.set_level(self.level or self.available_levels()[-1])  # back to the level and its own LoRA
            self._mixed = False
        if experts is not None:
            self.mix_experts(prompt, experts)

    # -- running -------------------------------------------------------------------------

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of the current level for token ids [B, T] (no cache kept)."""
        return self.transformer(ids)

    @property
    def latency_profile(self) -> LatencyProfile:
        """This device's measured profile for this weight format, else a quick estimate."""
        if self._profile is None:
            path = profile_path(self.package_dir, self.weight_format)
            profile = LatencyProfile.load(path) if path.is_file() else estimate_profile(self)
            profile.drift = Drift(headroom=SERVING_HEADROOM)
            if self.tlm is not None and profile.tlm is None:  # the TLM's time counts in TTFT: time it here, once
                profile.tlm = measure_tlm_latency(self.tlm)
            self._profile = profile
        return self._profile

    @latency_profile.setter
    def latency_profile(self, profile: LatencyProfile) -> None:
        self._profile = profile

    def generate(self, prompt: str | ChatPrompt, slo: SLO | None = None, max_new_tokens: int = 64,
                 stream: bool = False, level: str | float | None = None, profile: str | None = None,
                 experts: str | None = None, sampling: Sampling | None = None, stop: Sequence[str] = (),
                 keep: str | None = None, min_new_tokens: int = 1):
        """Generation at the level the SLO allows (or `level`), with measured TTFT/TPOT.

        Greedy unless `sampling` says otherwise. `keep`, an end of `prompt` (the question after a
        few-shot block or a passage), is never compressed: the TLM compresses only what comes before
        it. By default (None) it is the prompt's question (`tlm.question_tail`: from its last
        "Question:" line, else its last paragraph's last line with a "?", else its last line); "" lets all of it compress.
        A `ChatPrompt` compresses only the contents of the turns before the last user turn, then its
        template renders: the template's text and the last user turn are served as written (no `keep`).
        Generation ends at the end-of-sequence token, at
        `max_new_tokens`, or at the first of the `stop` strings, which is left out of the text
        (finish_reason "stop"); streamed text holds back what could be the start of a stop string.
        The end-of-sequence token cannot come before `min_new_tokens` tokens: a model told "do not add
        anything else" (or shown a compressed prompt) may end at once, and an empty answer is never what
        the caller asked for; 0 lets it.
        With `stream=True` returns a GenerationStream of text pieces; else a Generation.
        """
        if not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError(f"min_new_tokens must be in 0..max_new_tokens ({max_new_tokens}), not {min_new_tokens}")
        if any(not s for s in stop):
            raise ValueError("a stop string must not be empty")
        if isinstance(prompt, ChatPrompt):
            if keep:
                raise ValueError("`keep` is for a plain prompt; a chat keeps its last user turn whole")
            keep = ""
        elif keep is None:
            keep = question_tail(prompt)
        elif not prompt.endswith(keep):
            raise ValueError("`keep` must be the end of the prompt")
        steps = self._generate(prompt, slo, max_new_tokens, level, profile, experts, sampling, tuple(stop), keep,
                               min_new_tokens)
        if stream:
            return GenerationStream(steps)
        try:
            while True:
                next(steps)
        except StopIteration as done:
            return done.value

    @torch.inference_mode()
    def _generate(self, request: str | ChatPrompt, slo: SLO | None, max_new_tokens: int, level, profile=None,
                  experts=None, sampling: Sampling | None = None, stops: tuple[str, ...] = (),
                  keep: str = "", min_new_tokens: int = 1) -> Iterator[str]:
        latency = self.latency_profile if slo is not None else None  # read or measured once, not per request
        # TTFT runs from here: rendering, tokenising, the TLM's decision and compression, prefill.
        started = time.perf_counter()
        prompt = request.text if isinstance(request, ChatPrompt) else request
        served = prompt
        ids = self.tokenizer.encode(prompt).ids
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        levels = [self.manifest.elastic.level(name) for name in self.available_levels()]
        if level is not None:
            forced = self.manifest.elastic.level(level)
            if not forced.usable:
                log.warning("level %s is marked unusable by the package's report card (%s); generating at it "
                            "because it was asked for", forced.name, _quality_summary(forced))
            decision = Decision(forced.name)
        elif slo is not None:
            decision = self.decide(prompt, len(ids), slo, latency, levels,
                                   kept_tokens=self._kept_tokens(request, len(ids), keep))
        else:
            decision = Decision(levels[-1].name)
        prompt_tokens = len(ids)  # a relative SLO is relative to the full model on the prompt as given
        if decision.prompt_ratio < 1.0 and self.compress is not None:
            served = self._compressed(request if isinstance(request, ChatPrompt) else prompt,
                                      decision.prompt_ratio, keep)
            ids = self.tokenizer.encode(served).ids
        if decision.level != self.level:
            self.set_level(decision.level)  # KV cache is per request, so switching here is safe
        context = self.manifest.architecture.max_position
        if len(ids) > context:  # before the KV cache, the attention mask or any activation is allocated
            raise PromptTooLong(f"the prompt is {len(ids)} tokens; the model's context is {context} tokens "
                                "(max_position), prompt and completion together")
        self._clone_setup(prompt, slo, len(ids), profile, experts)
        max_len = min(len(ids) + max_new_tokens, context)
        cache = self.transformer.new_cache(max_len)
        sampling = sampling or GREEDY
        pick = sampling.picker()
        penalties = sampling.penalties(ids, self.manifest.architecture.vocab)
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        tokens: list[int] = []
        stamps: list[float] = []
        shown = 0  # characters of the decoded text already yielded
        stopped = False
        next_input = torch.tensor([ids])
        prefill_started = time.perf_counter()
        while len(tokens) < max_new_tokens and cache.length < max_len:
            logits = self.transformer(next_input, cache, last_only=True)[0, -1]
            if penalties is not None:
                logits = penalties(logits)
            if len(tokens) < min_new_tokens and len(eos):
                logits = logits.index_fill(0, eos, float("-inf"))
            token = pick(logits)
            stamps.append(time.perf_counter())
            tokens.append(token)
            if penalties is not None:
                penalties.add(token)
            if token in self.eos_ids:
                break
            decoded = self.tokenizer.decode(tokens)
            if not decoded.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                found = [at for at in (decoded.find(s) for s in stops) if at >= 0]
                if found:
                    stopped = True
                    if min(found) > shown:
                        yield decoded[shown:min(found)]
                    break
                end = len(decoded) - _held_back(decoded, stops)
                if end > shown:
                    yield decoded[shown:end]
                    shown = end
            next_input = torch.tensor([[token]])
        text = self.tokenizer.decode([t for t in tokens if t not in self.eos_ids])
        if stopped:
            text = text[:min(at for at in (text.find(s) for s in stops) if at >= 0)]
        elif len(text) > shown:  # what was held back for a stop string that never came
            yield text[shown:]
        ttft_ms = (stamps[0] - started) * 1000
        tpot_ms = (stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1) if len(stamps) > 1 else None
        met = True
        if slo is not None:
            target = slo.absolute(latency, prompt_tokens) if slo.relative else slo
            met = target.met(ttft_ms, tpot_ms)
            if level is None and self.profile is None and not self._mixed:  # served at a level's own widths
                latency.observe(self.level, len(ids), (stamps[0] - prefill_started) * 1000, tpot_ms)
        finish = "stop" if stopped or tokens[-1] in self.eos_ids else "length"
        return Generation(text, tokens, self.level, ttft_ms, tpot_ms, met, len(ids), finish, decision, served)

    def _kept_tokens(self, request: str | ChatPrompt, prompt_tokens: int, keep: str) -> int:
        """Tokens of the prompt compression never touches, for the cost model: `keep`, or all of a chat
        but its compressible contents (the template's text and the last user turn)."""
        if isinstance(request, ChatPrompt):
            compressible = sum(len(self.tokenizer.encode(content, add_special_tokens=False).ids)
                               for content in request.compressible_text())
            return max(0, prompt_tokens - compressible)
        return min(len(self.tokenizer.encode(keep, add_special_tokens=False).ids), prompt_tokens) if keep else 0

