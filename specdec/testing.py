"""Test utilities: tiny random-initialised Llama-family models built from a config, a tiny
character-level tokenizer, and a random-tree test drafter.

Used by specdec's own tests and handy for drafter authors:
``build_tiny_model("qwen3-qknorm", vocab_size=8)`` gives a 2-layer model in milliseconds;
``save_tiny_checkpoint(path)`` writes a model + tokenizer directory that ``specdec generate --model`` loads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.drafters.base import Drafter

if TYPE_CHECKING:
    from specdec.attention import SeqAttention

TINY_VARIANTS = {
    # name: (config class name, extra config kwargs)
    "llama-gqa-tied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mha-untied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-mqa-bias": ("LlamaConfig", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
    "llama3-rope": (
        "LlamaConfig",
        dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=64)),
    ),
    "llama-linear-rope": ("LlamaConfig", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "llama-yarn-rope": ("LlamaConfig", dict(rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                               original_max_position_embeddings=128))),
    "qwen2-bias": ("Qwen2Config", dict(num_key_value_heads=2)),
    "qwen3-qknorm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=None)),
}


def build_tiny_model(variant: str = "llama-gqa-tied", vocab_size: int = 96, seed: int = 0, **overrides):
    import transformers

    cls_name, extra = TINY_VARIANTS[variant]
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=None, pad_token_id=0, rms_norm_eps=1e-6,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model_cls = {"LlamaConfig": transformers.LlamaForCausalLM, "Qwen2Config": transformers.Qwen2ForCausalLM,
                 "Qwen3Config": transformers.Qwen3ForCausalLM,
                 "MistralConfig": transformers.MistralForCausalLM}[cls_name]
    model = model_cls(config).eval()
    with torch.no_grad():  # random init is near-uniform; sharpen it so greedy has clear winners
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


TINY_CHARS = "abcdefghijklmnopqrstuvwxyz .,?!'0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def build_tiny_tokenizer():
    """A character-level fast tokenizer: id 0 is ``[UNK]``, then one id per character of TINY_CHARS."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(TINY_CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.decoder = decoders.Fuse()  # characters are joined as they are, without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]")


def save_tiny_checkpoint(path, variant: str = "llama-gqa-tied", tokenizer: bool = True, seed: int = 0) -> str:
    """Save a tiny model (vocabulary = the tiny tokenizer's) and, if asked, its tokenizer to `path`."""
    tok = build_tiny_tokenizer()
    build_tiny_model(variant, vocab_size=len(tok), seed=seed).save_pretrained(path)
    if tokenizer:
        tok.save_pretrained(path)
    return str(path)


class RandomTreeDrafter(Drafter):
    """A test drafter that proposes random trees, to exercise rejection and KV compaction hard.

    ``mode="deterministic"``: random distinct tokens per node, no draft_probs.
    ``mode="independent"`` / ``"without_replacement"``: each node's children are really
    sampled from a random distribution (draft_probs), as an honest stochastic drafter must.
    ``vocab_size`` limits drawn tokens. So that some drafts are accepted, deterministic picks
    put a token of the sequence first half the time, and ``history_bias=b`` (stochastic modes)
    moves mass ``b`` of each node's distribution onto a random token of the sequence (the tokens
    are still really drawn from the ``draft_probs`` reported). Its draws restart from ``seed`` at every ``attach``:
    a reused instance drafts as a fresh one (drafters/base.py).
    """

    name = "random-tree"

    def __init__(self, vocab_size: int, max_nodes: int = 12, max_depth: int = 4, max_width: int = 3,
                 mode: str = "deterministic", seed: int = 0, temperature: float = 1.0,
                 history_bias: float = 0.0) -> None:
        import random

        from specdec.tree import DraftMode

        self.vocab_size, self.max_nodes, self.max_depth, self.max_width = vocab_size, max_nodes, max_depth, max_width
        self.mode = DraftMode(mode)
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed)  # the sampled tokens' draws
        self.rng = random.Random(seed)  # shapes, deterministic picks, history tokens: no tensor op per draw
        self.temperature = temperature
        if not 0.0 <= history_bias <= 1.0:
            raise ValueError(f"history_bias must lie in [0, 1], got {history_bias}")
        self.history_bias = history_bias

    def attach(self, target) -> None:
        super().attach(target)
        self.gen.manual_seed(self.seed)
        self.rng.seed(self.seed)

    def draw_source(self, seed):  # the seed of its own it restarts from at each attach (Drafter.draw_source)
        return self.seed

    def _dists(self) -> torch.Tensor:
        """A random distribution per expansion a tree can make (its root's and each node's): [max_nodes + 1, vocab],
        drawn at once."""
        noise = torch.randn(self.max_nodes + 1, self.vocab_size, generator=self.gen, dtype=torch.float32)
        return torch.softmax(noise * 2 / self.temperature, -1)  # float32 whatever the default dtype

    def _propose_one(self, history):
        from specdec.tree import DraftMode, DraftTree

        deterministic = self.mode is DraftMode.DETERMINISTIC
        dists = None if deterministic else self._dists()
        tokens, parents, rows = [], [], []
        frontier = [-1]
        depth = expansions = 0
        while frontier and len(tokens) < self.max_nodes and depth < self.max_depth:
            nxt = []
            for parent in frontier:
                # the root has at least one child
                width = self.rng.randint(0 if parent >= 0 else 1, self.max_width)
                if deterministic:
                    picks = self.rng.sample(range(self.vocab_size), min(width, self.vocab_size))
                    if history and width and self.rng.randrange(2):
                        cand = self.rng.choice(history)
                        picks = [cand] + [t for t in picks if t != cand][: width - 1]
                else:
                    dist = dists[expansions]
                    expansions += 1
                    if self.history_bias and history:
                        cand = self.rng.choice(history)
                        if cand < self.vocab_size:
                            dist = dist * (1 - self.history_bias)
                            dist[cand] += self.history_bias
                    replacement = self.mode is DraftMode.INDEPENDENT
                    picks = torch.multinomial(dist, width if replacement else min(width, self.vocab_size),
                                              replacement=replacement, generator=self.gen).tolist() if width else []
                for t in picks:
                    if len(tokens) >= self.max_nodes:
                        break
                    nxt.append(len(tokens))
                    tokens.append(t)
                    parents.append(parent)
                    rows.append(None if deterministic else dist)
            frontier = nxt
            depth += 1
        if deterministic:
            return DraftTree(tokens, parents, None, self.mode)
        return DraftTree(tokens, parents, torch.stack(rows), self.mode) if tokens else DraftTree.empty()

    def propose(self, seqs):
        return [self._propose_one(list(s.token_ids)) for s in seqs]


def ragged_prompts(n: int, vocab_size: int = 96, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    """`n` prompts of different lengths (1 to `max_len` tokens), every third one repetitive so that
    prompt-lookup drafters find matches; deterministic for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        length = 1 if i == 0 else 2 + (i * 7 + int(torch.randint(0, max_len, (1,), generator=gen))) % (max_len - 1)
        if i % 3 == 2:
            motif = torch.randint(1, vocab_size, (1 + i % 4,), generator=gen).tolist()
            prompts.append((motif * length)[:length])
        else:
            prompts.append(torch.randint(1, vocab_size, (length,), generator=gen).tolist())
    return prompts


def seq_attention_from_mask(query_start: int, key_slots: torch.Tensor, num_cached: int,
                            new_mask: torch.Tensor | None) -> "SeqAttention":
    """A SeqAttention from a dense [n, n] mask over the n new tokens that follow ``num_cached`` keys (every
    query sees all cached keys); None = causal. For tests that think in masks; n <= 64 for a mask."""
    from specdec.attention import SeqAttention

    n = key_slots.numel() - num_cached
    if new_mask is None:
        return SeqAttention(query_start, n, key_slots, num_cached)
    weights = torch.ones(n, dtype=torch.long) << torch.arange(n)
    bits = (new_mask.cpu().long() * weights).sum(-1)
    return SeqAttention(query_start, n, key_slots, num_cached, bits.to(key_slots.device))
