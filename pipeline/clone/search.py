"""Stage `clone-search`: generative search over per-layer ratio vectors (docs/design.md, 'clone-search').

The controller is an encoder–evaluator–decoder in the manner of NAO: a vector is a sequence of
ratio-bin tokens, one per layer. An LSTM encoder (embedding 64, hidden 64) maps it to per-layer
states, L2-normalised, whose normalised mean is the vector's embedding; an evaluator MLP
(2 × 200, sigmoid) predicts its min-max-normalised score from the embedding; an LSTM decoder with
dot-product attention over the encoder states rebuilds the sequence. Loss = 0.05·MSE(score) +
0.95·reconstruction NLL, on the top records of one budget, each also fed with one layer nudged by
a bin (a denoising augmentation: the decoder must still rebuild the clean vector).

Search, per budget, in rounds as NAO does: train the controller on the records so far; from the
top-k records, step the encoder states along the gradient of the predicted score with increasing
step sizes, decode each moved embedding by beam search, until N new vectors exist; measure each
of them for real (same model, text and cost model as the collection) and add them to the records,
so the next round trains on them and may start from them. A budget's profile is the measured
configuration (of any budget's search, or collected) with the highest score (`strict`: the lowest
perplexity among those whose predicted latency and energy fit the budget; its ascent then starts
from the best records within the budget).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from device_sdk.format import atomic_write_bytes, read_manifest, rewrite_manifest
from pipeline.clone.collect import CloneError, Collector, read_records
from pipeline.settings import CollectSettings, SearchSettings
from pipeline.stage import StageContext

MSE_WEIGHT = 0.05  # the rest, 0.95, weighs the reconstruction NLL


# --------------------------------------------------------------------------- the controller


class Controller(nn.Module):
    def __init__(self, vocab: int, length: int, embedding: int = 64, hidden: int = 64, mlp: int = 200):
        super().__init__()
        if embedding != hidden:
            raise CloneError("the decoder starts from the sequence embedding, so embedding must equal hidden")
        self.vocab, self.length = vocab, length
        self.embed = nn.Embedding(vocab, embedding)
        self.encoder = nn.LSTM(embedding, hidden, batch_first=True)
        self.evaluator = nn.Sequential(nn.Linear(hidden, mlp), nn.ReLU(), nn.Linear(mlp, mlp), nn.ReLU(),
                                       nn.Linear(mlp, 1), nn.Sigmoid())
        self.start = vocab  # the decoder's start-of-sequence token
        self.decoder_embed = nn.Embedding(vocab + 1, embedding)
        self.decoder = nn.LSTM(embedding, hidden, batch_first=True)
        self.combine = nn.Linear(2 * hidden, hidden)
        self.out = nn.Linear(hidden, vocab)

    def encode(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-layer states [B, L, H], embedding [B, H]), both L2-normalised."""
        states, _ = self.encoder(self.embed(tokens))
        states = F.normalize(states, dim=-1)
        return states, F.normalize(states.mean(1), dim=-1)

    def predict(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.evaluator(embedding).squeeze(-1)

    def _step(self, inputs: torch.Tensor, state, states: torch.Tensor):
        output, state = self.decoder(self.decoder_embed(inputs), state)  # [B, T, H]
        attention = torch.softmax(output @ states.transpose(1, 2), dim=-1)  # over the encoder's layers
        mixed = torch.tanh(self.combine(torch.cat([output, attention @ states], dim=-1)))
        return F.log_softmax(self.out(mixed), dim=-1), state

    def reconstruct(self, states: torch.Tensor, embedding: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Teacher-forced log-probabilities [B, L, vocab] of `targets`."""
        start = torch.full((targets.shape[0], 1), self.start, dtype=torch.long)
        inputs = torch.cat([start, targets[:, :-1]], dim=1)
        initial = (embedding[None].contiguous(), embedding[None].contiguous())
        return self._step(inputs, initial, states)[0]

    @torch.no_grad()
    def beam_decode(self, states: torch.Tensor, embedding: torch.Tensor, width: int) -> list[list[int]]:
        """Beam search for one embedding ([1, L, H], [1, H]): every final beam, most likely first."""
        beams = [([], 0.0, (embedding[None].contiguous(), embedding[None].contiguous()))]
        for _ in range(self.length):
            grown = []
            for tokens, logp, state in beams:
                last = torch.tensor([[tokens[-1] if tokens else self.start]])
                log_probs, new_state = self._step(last, state, states)
                top = log_probs[0, -1].topk(min(width, self.vocab))
                grown += [(tokens + [int(t)], logp + float(v), new_state) for v, t in zip(top.values, top.indices,
                                                                                          strict=True)]
            beams = sorted(grown, key=lambda beam: -beam[1])[:width]
        return [tokens for tokens, _, _ in beams]


# --------------------------------------------------------------------------- training


def normalised_scores(records: list[dict], budget: str) -> torch.Tensor:
    scores = torch.tensor([r["scores"][budget] for r in records], dtype=torch.float32)
    low, high = scores.min(), scores.max()
    return (scores - low) / (high - low) if high > low else torch.full_like(scores, 0.5)


def training_set(records: list[dict], budget: str, settings: SearchSettings, vocab: int,
                 rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, clean targets, normalised scores) of the top records plus their nudged copies."""
    top = sorted(records, key=lambda r: -r["scores"][budget])[: settings.top_records]
    clean = torch.tensor([r["bins"] for r in top])
    scores = normalised_scores(top, budget)
    inputs, targets, labels = [clean], [clean], [scores]
    for _ in range(settings.augment):
        nudged = clean.clone()
        layer = torch.tensor([rng.randrange(clean.shape[1]) for _ in range(len(top))])
        step = torch.tensor([rng.choice((-1, 1)) for _ in range(len(top))])
        rows = torch.arange(len(top))
        nudged[rows, layer] = (nudged[rows, layer] + step).clamp(0, vocab - 1)
        inputs.append(nudged)
        targets.append(clean)
        labels.append(scores)
    return torch.cat(inputs), torch.cat(targets), torch.cat(labels)


def train_controller(records: list[dict], budget: str, vocab: int, settings: SearchSettings,
                     ctx: StageContext) -> tuple[Controller, dict]:
    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    inputs, targets, labels = training_set(records, budget, settings, vocab, rng)
    controller = Controller(vocab, inputs.shape[1])
    optimizer = torch.optim.Adam(controller.parameters(), lr=settings.lr)
    generator = torch.Generator().manual_seed(settings.seed)
    mse = nll = float("nan")
    for epoch in range(settings.epochs):
        order = torch.randperm(inputs.shape[0], generator=generator)
        for batch in order.split(settings.batch_size):
            states, embedding = controller.encode(inputs[batch])
            mse_loss = F.mse_loss(controller.predict(embedding), labels[batch])
            log_probs = controller.reconstruct(states, embedding, targets[batch])
            nll_loss = F.nll_loss(log_probs.reshape(-1, vocab), targets[batch].reshape(-1))
            loss = MSE_WEIGHT * mse_loss + (1 - MSE_WEIGHT) * nll_loss
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(controller.parameters(), 5.0)
            optimizer.step()
            mse, nll = mse_loss.item(), nll_loss.item()
        ctx.report(f"clone-search {budget}: train controller", epoch + 1, settings.epochs)
    controller.eval()
    return controller, {"train_mse": mse, "train_nll": nll, "examples": int(inputs.shape[0])}


# --------------------------------------------------------------------------- generating


def moved(controller: Controller, tokens: torch.Tensor, step: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoder states moved `step` along the gradient of the predicted score; (states, embedding)."""
    with torch.enable_grad():
        states, _ = controller.encode(tokens)
        states = states.detach().requires_grad_(True)
        predicted = controller.predict(F.normalize(states.mean(1), dim=-1)).sum()
        (gradient,) = torch.autograd.grad(predicted, states)
    # A unit direction per vector: the raw gradient of a sigmoid is tiny where the evaluator is
    # confident, so `step` is measured in units of the (normalised) states instead.
    direction = gradient / gradient.flatten(1).norm(dim=1).clamp_min(1e-12)[:, None, None]
    new_states = F.normalize(states.detach() + step * direction * states.shape[1] ** 0.5, dim=-1)
    return new_states, F.normalize(new_states.mean(1), dim=-1)


def generate(controller: Controller, seeds: list[list[int]], known: set[tuple[int, ...]],
             settings: SearchSettings) -> list[list[int]]:
    """Up to `settings.candidates` new vectors (not in `known`), from the seeds with growing steps."""
    found: list[list[int]] = []
    seen = set(known)
    tokens = torch.tensor(seeds)
    for k in range(1, settings.max_steps + 1):
        states, embedding = moved(controller, tokens, settings.step_size * k)
        for row in range(len(seeds)):
            for vector in controller.beam_decode(states[row:row + 1], embedding[row:row + 1], settings.beam_width):
                if tuple(vector) not in seen:
                    seen.add(tuple(vector))
                    found.append(vector)
                    if len(found) >= settings.candidates:
                        return found
    return found


# --------------------------------------------------------------------------- the stage


def feasible(record: dict, budget: dict) -> bool:
    """Within the budget's latency and energy (a null side is unbounded)."""
    return all(budget[key] is None or record[key] <= budget[key] for key in ("latency_ms", "energy_j"))


def best_feasible(records: list[dict], budget: dict) -> dict | None:
    fitting = [r for r in records if feasible(r, budget)]
    return min(fitting, key=lambda r: r["ppl"]) if fitting else None


def best_record(records: list[dict], name: str, budget: dict, strict: bool) -> dict | None:
    """The budget's best: highest CLONE score, or (strict) lowest perplexity within the budget."""
    if strict:
        return best_feasible(records, budget)
    return max(records, key=lambda r: r["scores"][name], default=None)


def seed_vectors(records: list[dict], name: str, budget: dict, settings: SearchSettings) -> list[list[int]]:
    """The top-k records by the budget's score that the gradient ascent starts from; `strict`
    ranks those within the budget first, since the profile has to end up there."""
    ranked = sorted(records, key=lambda r: -r["scores"][name])
    if settings.strict:
        ranked = [r for r in ranked if feasible(r, budget)] + [r for r in ranked if not feasible(r, budget)]
    return [r["bins"] for r in ranked[: settings.seeds]]


def one_thread(fn, *args):
    """Run `fn` on one torch thread: the controller's small recurrent ops lose far more to thread
    hand-offs than they gain (5x slower on 2 threads of a busy 2-core host)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(previous)


def search(package_dir: Path, record_paths: list[Path], settings: SearchSettings, ctx: StageContext,
           latency_report: dict | None = None) -> dict:
    """Train a controller per budget, generate and measure candidates, pick one profile per budget."""
    header, records = read_records(record_paths)
    collect_settings = CollectSettings(**{**header["settings"], "shard": 0, "shards": 1})
    vocab = len(collect_settings.ratio_bins)
    collector = Collector(package_dir, collect_settings, latency_report)
    known = {tuple(r["bins"]) for r in records}
    results, profiles = {}, {}
    for name, budget in header["budgets"].items():
        training = []
        for round_index in range(settings.rounds):
            controller, trained = one_thread(train_controller, records, name, vocab, settings, ctx)
            vectors = one_thread(generate, controller, seed_vectors(records, name, budget, settings), known, settings)
            with torch.inference_mode():
                measured = [collector.evaluate(v, "search") for v in ctx.track(
                    vectors, f"clone-search {name}: round {round_index + 1}/{settings.rounds}: measure candidates")]
            known |= {tuple(v) for v in vectors}
            records += measured
            training.append(trained | {"candidates": len(measured)})
            if not vectors:  # the controller decodes nothing new any more
                break
        results[name] = {"training": training, "candidates": sum(t["candidates"] for t in training)}
    # Every measured configuration competes for every budget: a vector found while searching one
    # budget may be the best fit of another.
    searched = [r for r in records if r["origin"] == "search"]
    collected = [r for r in records if r["origin"] != "search"]
    for name, budget in header["budgets"].items():
        best_searched = best_record(searched, name, budget, settings.strict)
        best_collected = best_record(collected, name, budget, settings.strict)
        chosen = best_record([r for r in (best_searched, best_collected) if r is not None], name, budget,
                             settings.strict)
        if chosen is None:
            raise CloneError(
                f"budget {name!r} ({budget['latency_ms']} ms, {budget['energy_j']} J per request) was met by none "
                f"of {len(records)} measured configurations; raise the budget or collect more samples"
            )
        profiles[name] = profile_entry(chosen, budget)
        results[name] |= {"best_searched": best_searched, "best_collected": best_collected}
    return {"clone": {"profiles": profiles, "cost_model": cost_model_entry(header)}, "search": results,
            "records": records}


def profile_entry(record: dict, budget: dict) -> dict:
    keys = ("attn_units", "mlp_units", "ratios", "ppl", "ttft_ms", "tpot_ms", "latency_ms", "energy_j",
            "active_fraction", "origin")
    return {**{k: record[k] for k in keys}, "budget": dict(budget)}


def cost_model_entry(header: dict) -> dict:
    settings = header["settings"]
    return {"prompt_tokens": settings["prompt_tokens"], "decode_tokens": settings["decode_tokens"],
            "host": header["host"], "energy": header["energy"], "full": header["full"],
            "ppl_corpus": settings["corpus"]}


def install_profiles(package_dir: Path, profiles_path: Path) -> None:
    """Write the search's profiles into the package manifest (`clone`); the manifest validates them."""
    manifest = read_manifest(package_dir)
    manifest.clone = json.loads(Path(profiles_path).read_text())["clone"]
    rewrite_manifest(Path(package_dir), manifest)


def run(inputs: dict[str, Path], settings: SearchSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"package", "records.<shard>"…, optional "latency"} -> {"profiles": profiles.json}."""
    paths = [Path(p) for key, p in sorted(inputs.items()) if key == "records" or key.startswith("records.")]
    report = json.loads(Path(inputs["latency"]).read_text()) if "latency" in inputs else None
    result = search(Path(inputs["package"]), paths, settings, ctx, report)
    out = ctx.work_dir / "profiles.json"
    atomic_write_bytes(out, json.dumps(result, indent=1, allow_nan=False).encode())
    for name, entry in result["clone"]["profiles"].items():
        ctx.logger.info("clone profile %s: ppl %.2f, %.1f ms, %.3g J (%s)", name, entry["ppl"], entry["latency_ms"],
                        entry["energy_j"], entry["origin"])
    return {"profiles": out}

