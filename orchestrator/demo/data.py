"""The demo's small tokenized dataset and small target model, made with the standard library.

Data: documents drawn from a sparse Markov chain over the vocabulary (each token has a few
likely successors), so a drafter can learn them and the loss goes down. Written as shards
``shard-NNNNN.tokens`` (uint32 little-endian ids) and ``shard-NNNNN.docs`` (uint32 lengths).
Model: ``config.json`` (sizes and the ordered parameter list) and ``model.bin`` (float32
little-endian, the parameters in that order), the layout orchestrator/demo/job/train.py reads.
"""

from __future__ import annotations

import json
import random
import sys
from array import array
from pathlib import Path


def target_params(vocab: int, d: int, layers: int) -> list[tuple[str, list[int]]]:
    params: list[tuple[str, list[int]]] = [("emb.weight", [vocab, d])]
    for i in range(layers):
        b = f"blocks.{i}."
        params += [
            (b + "n1.weight", [d]), (b + "n1.bias", [d]), (b + "n2.weight", [d]), (b + "n2.bias", [d]),
            (b + "qkv.weight", [3 * d, d]), (b + "qkv.bias", [3 * d]),
            (b + "proj.weight", [d, d]), (b + "proj.bias", [d]),
            (b + "mlp.0.weight", [4 * d, d]), (b + "mlp.0.bias", [4 * d]),
            (b + "mlp.2.weight", [d, 4 * d]), (b + "mlp.2.bias", [d]),
        ]
    return params + [("norm.weight", [d]), ("norm.bias", [d])]


def _le(a: array) -> bytes:
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def write_model(dest: Path, *, vocab: int = 512, d: int = 96, layers: int = 2, heads: int = 4, seed: int = 1) -> int:
    rng = random.Random(seed)
    dest.mkdir(parents=True, exist_ok=True)
    params = target_params(vocab, d, layers)
    flat = array("f")
    for name, shape in params:
        n = 1
        for s in shape:
            n *= s
        if name.endswith(("n1.weight", "n2.weight", "norm.weight")):
            flat.extend([1.0] * n)
        elif name.endswith(".bias"):
            flat.extend([0.0] * n)
        else:
            std = 0.3 if name == "emb.weight" else 0.02
            flat.extend(rng.gauss(0.0, std) for _ in range(n))
    (dest / "model.bin").write_bytes(_le(flat))
    cfg = {"kind": "plain", "vocab": vocab, "d_model": d, "n_layers": layers, "n_heads": heads,
           "params": [[n, s] for n, s in params]}
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    return len(flat) * 4


def write_data(dest: Path, *, vocab: int = 512, shards: int = 4, tokens_per_shard: int = 40_000, seed: int = 2) -> int:
    rng = random.Random(seed)
    dest.mkdir(parents=True, exist_ok=True)
    succ = [[rng.randrange(vocab) for _ in range(3)] for _ in range(vocab)]
    total = 0
    for s in range(shards):
        toks, lens = array("i"), array("i")
        while len(toks) < tokens_per_shard:
            n = min(rng.randint(40, 400), tokens_per_shard - len(toks))
            t = rng.randrange(vocab)
            for _ in range(n):
                toks.append(t)
                t = rng.choice(succ[t]) if rng.random() < 0.95 else rng.randrange(vocab)
            lens.append(n)
        (dest / f"shard-{s:05d}.tokens").write_bytes(_le(toks))
        (dest / f"shard-{s:05d}.docs").write_bytes(_le(lens))
        total += len(toks)
    return total
