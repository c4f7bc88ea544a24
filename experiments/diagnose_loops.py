"""Why the level's greedy loops survive on-policy distillation: the numbers behind experiments/results/recovery-onpolicy-screen.json.

(1) On the level's own greedy continuations of the first 8 everyday prompts (64 tokens), the mean
probability of the tokens that repeat a 4-gram, under the level (its LoRA on) and under the full model
(the same weights at 1.0, LoRA off) given the same looping prefix. (2) On one recovery batch, the KL
on corpus text against the KL on the level's own continuation, and the gradient norms with and
without the unlikelihood term (the recover stage's own functions). Prints one JSON line.

  .venv/bin/python -m experiments.diagnose_loops --package /tmp/bench-recovery-48/package \\
      --adapter /tmp/bench-recovery-48/adapters/distill-0.5.safetensors \\
      --corpus ~/.cache/elastify/bench/recovery-corpus-<digest>
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.bench_recovery import training_kinds
from pipeline.elastilm.evaluate import GENERATION_PROMPTS
from pipeline.elastilm.recover import (
    LevelViews,
    add_lora,
    distill_loss,
    mixed_batches,
    repeated_ngram_positions,
    student_rollout,
    teacher_mode,
    teacher_targets,
    warm_start,
)
from pipeline.models.elastic import ElasticCausalLM
from pipeline.settings import RecoverSettings


def chosen_probs(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids).logits[0, :-1].softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True, help="the level's trained LoRA ((c) distillation)")
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--level", default="0.5")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.package / "model"))
    settings = RecoverSettings(level=args.level, steps=1, batch_size=4, seq_len=128)
    views = LevelViews(ElasticCausalLM.from_package(args.package), args.level)
    peft_model = add_lora(views.hf, settings)
    warm_start(peft_model, args.adapter, settings)
    level_p, full_p = [], []
    for prompt in GENERATION_PROMPTS[:8]:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        rolled, _ = student_rollout(views.hf, torch.cat([ids, torch.zeros(1, 64, dtype=torch.long)], 1), ids.shape[1])
        repeated = repeated_ngram_positions(rolled, ids.shape[1])[0, 1:]
        if repeated.any():
            level_p.append(chosen_probs(views.hf, rolled)[repeated].mean().item())
            with teacher_mode(views, "1.0", peft_model):
                full_p.append(chosen_probs(views.hf, rolled)[repeated].mean().item())
    batches, _ = mixed_batches(tokenizer, training_kinds(args.corpus), settings)
    ids, labels = batches[0]
    params = [p for p in peft_model.parameters() if p.requires_grad]
    peft_model.train()
    first = {}
    for name, (i, lab) in (("corpus", (ids, labels)), ("rollout", student_rollout(views.hf, ids, 32))):
        teacher = teacher_targets(views, "1.0", peft_model, i, lab, 1.0, 0)
        repeated = repeated_ngram_positions(i, 32) if name == "rollout" else None
        for weight in (0.0, 1.0) if name == "rollout" else (0.0,):
            loss = distill_loss(views.hf, i, lab, teacher, 1.0, 0.0, repeated, weight)
            grads = torch.autograd.grad(loss, params)
            first[f"{name}, unlikelihood {weight}"] = {
                "loss": loss.item(), "grad_norm": torch.sqrt(sum((g**2).sum() for g in grads)).item()}
        if repeated is not None:
            first["rollout repeated share"] = repeated[:, 32:].float().mean().item()
    print(json.dumps({"repeated_token_prob": {"level": sum(level_p) / len(level_p), "full": sum(full_p) / len(full_p),
                                              "prompts": len(level_p)}, "first_batch": first}))


if __name__ == "__main__":
    main()
