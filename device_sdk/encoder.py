"""A BERT-style encoder over a dict of tensors: the MiniLM sentence embedder and the TLM's trunk.

No transformers: embeddings, post-LayerNorm layers with exact-erf GELU, as BERT defines them.
`MiniLMEncoder` adds the sentence-transformers recipe (mean pooling over real tokens, then L2
normalisation) that the expert router and the pipeline's task centroids both use.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer


def load_tokenizer(path: Path) -> Tokenizer:
    """A `tokenizer.json` with the file's fixed padding and truncation switched off (callers chunk)."""
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


class Encoder:
    """BERT layers named `<prefix>attention.self.query…`; `tensors` may hold several stacks of them."""

    def __init__(self, tensors: dict[str, torch.Tensor], config: dict, embeddings_prefix: str = "embeddings."):
        self.tensors = tensors
        self.heads = config["num_attention_heads"]
        self.eps = config.get("layer_norm_eps", 1e-12)
        if config.get("hidden_act", "gelu") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only BERT encoders with GELU and absolute positions are supported")
        self.embeddings_prefix = embeddings_prefix

    def _layer_norm(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.tensors[prefix + "weight"], self.tensors[prefix + "bias"], self.eps)

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.tensors[prefix + "weight"], self.tensors[prefix + "bias"])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, H]: word + position + segment 0, then LayerNorm."""
        p = self.embeddings_prefix
        positions = torch.arange(ids.shape[1])
        hidden = (self.tensors[p + "word_embeddings.weight"][ids]
                  + self.tensors[p + "position_embeddings.weight"][positions]
                  + self.tensors[p + "token_type_embeddings.weight"][0])
        return self._layer_norm(hidden, p + "LayerNorm.")

    def layer(self, hidden: torch.Tensor, prefix: str, mask: torch.Tensor) -> torch.Tensor:
        """One post-LN BERT layer; `mask` [B, T] is 1 for real tokens."""
        batch, length, width = hidden.shape

        def heads(x):
            return x.view(batch, length, self.heads, width // self.heads).transpose(1, 2)

        q, k, v = (heads(self._linear(hidden, f"{prefix}attention.self.{name}.")) for name in ("query", "key", "value"))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :].bool())
        attended = attended.transpose(1, 2).reshape(batch, length, width)
        hidden = self._layer_norm(hidden + self._linear(attended, f"{prefix}attention.output.dense."),
                                  f"{prefix}attention.output.LayerNorm.")
        inner = F.gelu(self._linear(hidden, f"{prefix}intermediate.dense."))
        return self._layer_norm(hidden + self._linear(inner, f"{prefix}output.dense."), f"{prefix}output.LayerNorm.")

    def run(self, hidden: torch.Tensor, prefixes: Sequence[str], mask: torch.Tensor) -> torch.Tensor:
        for prefix in prefixes:
            hidden = self.layer(hidden, prefix, mask)
        return hidden


def pad_batch(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T], mask [B, T]) right-padded to the longest row."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([list(row) + [pad_id] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return ids, mask


class MiniLMEncoder:
    """Sentence embeddings from a sentence-transformers BERT directory (MiniLM-L6 by default)."""

    def __init__(self, encoder: Encoder, tokenizer: Tokenizer, layers: int, max_length: int = 256):
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.prefixes = [f"encoder.layer.{i}." for i in range(layers)]
        self.max_length = max_length

    @classmethod
    def load(cls, model_dir: Path, max_length: int = 256) -> MiniLMEncoder:
        model_dir = Path(model_dir)
        missing = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir} is not a BERT model directory: missing {missing}")
        config = json.loads((model_dir / "config.json").read_text())
        tensors = {k.removeprefix("bert."): v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        return cls(Encoder(tensors, config), load_tokenizer(model_dir / "tokenizer.json"),
                   config["num_hidden_layers"], max_length)

    @torch.inference_mode()
    def embed(self, texts: Sequence[str], batch_size: int = 32) -> torch.Tensor:
        """[len(texts), H]: mean over real tokens of the last layer, L2-normalised."""
        if isinstance(texts, str):
            raise TypeError("embed takes a list of texts")
        out = []
        for start in range(0, len(texts), batch_size):
            rows = [e.ids[: self.max_length] for e in self.tokenizer.encode_batch(list(texts[start:start + batch_size]))]
            ids, mask = pad_batch(rows)
            hidden = self.encoder.run(self.encoder.embed(ids), self.prefixes, mask)
            weights = mask[..., None].to(hidden.dtype)
            out.append(F.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1))
        return torch.cat(out) if out else torch.empty(0, 0)
