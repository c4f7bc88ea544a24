"""This device's cost model: per-level latency profiles, SLOs, predicted TTFT and TPOT, and the level decision.

A profile holds, per level, TTFT in the prompt length (a line `base + per_token · n`, and where
three or more lengths were timed the measured points themselves, interpolated: prefill attention
grows faster than the line beyond a few hundred tokens) and TPOT, measured on this device for one
weight format (by `device_sdk.measure`); `elastify-device profile` writes it beside the package. `choose_level` is the decision until the package carries a TLM: the
largest level whose predicted TTFT and TPOT meet the SLO, else the smallest (best effort); either
way only among the levels the package marks usable (`usable_levels`).
A TLM replaces it by assigning a callable with the same signature to `ElasticModel.decide`.
Every request a decision served teaches the profile (`Drift`): predictions follow how this device
actually runs now, not only how it ran when profiled.
"""

from __future__ import annotations

import json
import platform
from collections import deque
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from device_sdk.format import Level, LevelShape, atomic_write_bytes


@dataclass(frozen=True)
class SLO:
    """Latency targets in milliseconds, or (relative=True) fractions of the full model's latency."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    relative: bool = False

    @classmethod
    def fraction(cls, ttft: float | None = None, tpot: float | None = None) -> SLO:
        return cls(ttft, tpot, relative=True)

    def absolute(self, profile: LatencyProfile, prompt_tokens: int) -> SLO:
        """Milliseconds for this prompt length: fractions are of the largest level's latency as profiled,
        not as `Drift` scales it (its upper quantile bounds a cell's latency; a reference is typical)."""
        if not self.relative:
            return self
        full = profile.largest_level()
        return SLO(
            None if self.ttft_ms is None else self.ttft_ms * profile.ttft_ms(full, prompt_tokens, calibrated=False),
            None if self.tpot_ms is None else self.tpot_ms * profile.tpot_ms(full, calibrated=False),
        )

    def met(self, ttft_ms: float, tpot_ms: float | None) -> bool:
        ttft_ok = self.ttft_ms is None or ttft_ms <= self.ttft_ms
        tpot_ok = self.tpot_ms is None or tpot_ms is None or tpot_ms <= self.tpot_ms
        return ttft_ok and tpot_ok


@dataclass
class LevelLatency:
    ttft_base_ms: float
    ttft_per_token_ms: float
    tpot_ms: float
    # (prompt tokens, TTFT ms) as measured, ascending; TTFT is interpolated between them and the last
    # segment extended beyond. None: the line alone (two lengths timed, or an older profile).
    ttft_points: list[tuple[int, float]] | None = None

    def ttft_ms(self, prompt_tokens: int) -> float:
        points = self.ttft_points
        if not points or len(points) < 2:
            return self.ttft_base_ms + self.ttft_per_token_ms * prompt_tokens
        segment = next((i for i in range(1, len(points) - 1) if prompt_tokens <= points[i][0]), len(points) - 1)
        (n0, t0), (n1, t1) = points[segment - 1], points[segment]
        return max(t0 + (t1 - t0) * (prompt_tokens - n0) / (n1 - n0), 0.0)


@dataclass
class TLMLatency:
    """The TLM's own time before prefill, as lines in the prompt's tokens: the decision runs on every
    request the TLM decides, the compression (score branch) only when the prompt ratio is below 1."""

    decide_base_ms: float
    decide_per_token_ms: float
    compress_base_ms: float
    compress_per_token_ms: float
    # The decision reads at most this many tokens (the TLM's window: the prompt's head and tail); None: all.
    decide_window: int | None = None

    def ms(self, prompt_tokens: int, compressing: bool, kept_tokens: int = 0) -> float:
        """The decision over the prompt (up to the window), and compression over all but its last
        `kept_tokens` (the end a request keeps whole is never scored)."""
        read = prompt_tokens if self.decide_window is None else min(prompt_tokens, self.decide_window)
        total = self.decide_base_ms + self.decide_per_token_ms * read
        if compressing:
            total += self.compress_base_ms + self.compress_per_token_ms * (prompt_tokens - kept_tokens)
        return total


# The headroom the device SDK serves SLO decisions with. Chosen on two served traces (experiments/replay_drift.py
# over trace-run1.json and trace-run2.json): 1.04 cut the violations of cells the quantile-scaled profile
# called feasible from 47 to 29 and from 65 to 12 (of ~1,500 each); 1.10 reached 14 and 3, at the price of
# a cheaper cell for 37% and 48% of those requests.
SERVING_HEADROOM = 1.04


@dataclass
class Drift:
    """How the requests this device serves run against its profile: per level, the last `window` ratios of
    measured to predicted prefill and TPOT. Predictions are scaled by their `quantile`, so a profile timed
    on a quieter machine (or more tightly than a request runs) stops promising cells that then miss, and a
    cell near its SLO's boundary keeps the headroom request-to-request noise needs. A level with fewer
    than `min_samples` requests of its own takes the ratios pooled over every level (load slows them all).
    `headroom` multiplies on top, from the first request on: the upper quantile still lets a tenth of the
    requests served right at a boundary run over it by a few percent. `quantile=None` switches both off:
    the profile as measured."""

    quantile: float | None = 0.9
    headroom: float = 1.0  # a build's cost model (label derivation) as measured; served: SERVING_HEADROOM
    window: int = 32
    min_samples: int = 4
    ratios: dict[tuple[str, str], deque] = field(default_factory=dict, repr=False)  # (kind, level or "*")
    # A decision asks for every cell's factor; the quantile is recomputed only after an observation.
    _factors: dict[tuple[str, str], float] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if not self.headroom >= 1.0:
            raise ValueError(f"Drift.headroom is a margin on the predictions, at least 1.0; got {self.headroom}")

    def observe(self, kind: str, level: str, measured_ms: float, predicted_ms: float) -> None:
        if predicted_ms <= 0 or measured_ms < 0:
            return
        ratio = min(max(measured_ms / predicted_ms, 0.25), 4.0)  # one stalled request must not rule a window
        for key in ((kind, level), (kind, "*")):
            self.ratios.setdefault(key, deque(maxlen=self.window)).append(ratio)
        self._factors.clear()

    def factor(self, kind: str, level: str) -> float:
        if self.quantile is None:
            return 1.0
        if (kind, level) not in self._factors:
            self._factors[kind, level] = self.headroom
            for key in ((kind, level), (kind, "*")):
                seen = self.ratios.get(key)
                if seen is not None and len(seen) >= self.min_samples:
                    self._factors[kind, level] *= float(torch.tensor(list(seen)).quantile(self.quantile))
                    break
        return self._factors[kind, level]


@dataclass
class LatencyProfile:
    weight_format: str
    threads: int
    levels: dict[str, LevelLatency]
    device: str = field(default_factory=platform.processor)
    measured_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))  # noqa: UP017 (3.10)
    estimated: bool = False  # True: only the full level was measured, the rest scaled by active fraction
    tlm: TLMLatency | None = None  # measured on the device where a TLM decides; None: not measured (counts 0)
    # What served requests taught this copy (never saved); `dataclasses.replace` shares it.
    drift: Drift = field(default_factory=Drift, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.tlm, dict):  # read back from JSON
            self.tlm = TLMLatency(**self.tlm)

    def tlm_ms(self, prompt_tokens: int, prompt_ratio: float, kept_tokens: int = 0) -> float:
        """The TLM's predicted time before prefill for this prompt (0 where it was not measured)."""
        return 0.0 if self.tlm is None else self.tlm.ms(prompt_tokens, prompt_ratio < 1.0, kept_tokens)

    def ttft_ms(self, level: str, prompt_tokens: int, calibrated: bool = True) -> float:
        """Prefill time of `prompt_tokens` at `level`; `calibrated`: scaled by what served requests showed."""
        measured = self.levels[level].ttft_ms(prompt_tokens)
        return measured * self.drift.factor("ttft", level) if calibrated else measured

    def tpot_ms(self, level: str, calibrated: bool = True) -> float:
        measured = self.levels[level].tpot_ms
        return measured * self.drift.factor("tpot", level) if calibrated else measured

    def observe(self, level: str, prompt_tokens: int, prefill_ms: float, tpot_ms: float | None) -> None:
        """A served request at `level`: its prefill of `prompt_tokens` and its TPOT, as measured."""
        self.drift.observe("ttft", level, prefill_ms, self.ttft_ms(level, prompt_tokens, calibrated=False))
        if tpot_ms is not None:
            self.drift.observe("tpot", level, tpot_ms, self.tpot_ms(level, calibrated=False))

    def largest_level(self) -> str:
        return max(self.levels, key=Level)

    def to_dict(self) -> dict:
        """The measured profile as JSON-ready fields (what requests taught it stays on this copy)."""
        data = asdict(self)
        data.pop("drift")
        return data

    def save(self, path: Path) -> None:
        atomic_write_bytes(Path(path), json.dumps(self.to_dict(), indent=2).encode())

    @classmethod
    def load(cls, path: Path) -> LatencyProfile:
        data = json.loads(Path(path).read_text())
        data["levels"] = {name: LevelLatency(**entry) for name, entry in data["levels"].items()}
        for entry in data["levels"].values():  # JSON has no tuples
            if entry.ttft_points is not None:
                entry.ttft_points = [tuple(point) for point in entry.ttft_points]
        return cls(**data)


@dataclass(frozen=True)
class EnergyProfile:
    """Energy per arithmetic operation and per byte moved from memory, for predicting a request's joules.

    Defaults are Horowitz, "Computing's energy problem" (ISSCC 2014), 45 nm: an fp32 multiply
    3.7 pJ + add 0.9 pJ = 4.6 pJ per multiply-add, i.e. 2.3 pJ per FLOP; a DRAM access ~640 pJ
    per 32-bit word, i.e. 160 pJ per byte. Only the ratio and the order of magnitude matter to
    the CLONE score; a device that measures its own replaces them.
    """

    joules_per_flop: float = 2.3e-12
    joules_per_byte: float = 160e-12
    source: str = "Horowitz ISSCC 2014, 45 nm (fp32 FMA 4.6 pJ; DRAM 640 pJ / 32-bit word)"

    def joules(self, flops: float, bytes_moved: float) -> float:
        return flops * self.joules_per_flop + bytes_moved * self.joules_per_byte


def profile_path(package_dir: Path, weight_format: str) -> Path:
    """Beside the package, not in it: the package stays exactly what was signed."""
    package_dir = Path(package_dir)
    return package_dir.parent / f"{package_dir.name}.latency-{weight_format}.json"


# --------------------------------------------------------------------------- the decision


@dataclass
class Decision:
    level: str
    prompt_ratio: float = 1.0  # a TLM may also compress the prompt; the profile rule never does
    feasible: bool = True
    tlm_ran: bool = False  # whether a TLM head was asked (its time is in this request's TTFT)


def usable_levels(levels: list[LevelShape]) -> list[LevelShape]:
    """The levels an SLO decision may pick: those the package's report card marked usable.

    A partial copy may hold none of them (every held level is below the usable ones); then its
    largest held level, the best quality it has.
    """
    usable = [shape for shape in levels if shape.usable]
    return usable or [max(levels, key=lambda shape: shape.level)]


def choose_level(prompt: str, prompt_tokens: int, slo: SLO, profile: LatencyProfile, levels: list[LevelShape],
                 kept_tokens: int = 0) -> Decision:
    """The largest usable level predicted to meet both targets; the smallest usable one when none is.

    Every decision takes these arguments; `kept_tokens` counts the prompt's end that compression
    never touches (this rule never compresses, so it ignores them)."""
    target = slo.absolute(profile, prompt_tokens)
    ordered = sorted(usable_levels(levels), key=lambda shape: shape.level)
    for level in reversed(ordered):
        ttft = profile.ttft_ms(level.name, prompt_tokens)
        tpot = profile.tpot_ms(level.name)
        if target.met(ttft, tpot):
            return Decision(level.name)
    return Decision(ordered[0].name, feasible=False)


def predicted_ttft_ms(profile: LatencyProfile, level: str, prompt_ratio: float, prompt_tokens: int,
                      kept_tokens: int = 0) -> float:
    """TTFT of `level` on the prompt with all but its last `kept_tokens` compressed to `prompt_ratio`,
    the TLM's own time included (where measured)."""
    if not 0 <= kept_tokens <= prompt_tokens:
        raise ValueError(f"kept_tokens must be in [0, {prompt_tokens}], got {kept_tokens}")
    served = max(1, kept_tokens + round(prompt_ratio * (prompt_tokens - kept_tokens)))
    return profile.tlm_ms(prompt_tokens, prompt_ratio, kept_tokens) + profile.ttft_ms(level, served)


def feasible(profile: LatencyProfile, level: str, prompt_ratio: float, prompt_tokens: int, slo: SLO,
             kept_tokens: int = 0) -> bool:
    """Whether `level` on the compressed prompt (see `predicted_ttft_ms`) is predicted to meet `slo`; TTFT
    counts the TLM's time where the profile holds it."""
    target = slo.absolute(profile, prompt_tokens)
    return target.met(predicted_ttft_ms(profile, level, prompt_ratio, prompt_tokens, kept_tokens),
                      profile.tpot_ms(level))
