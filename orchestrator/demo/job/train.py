"""A small but real DFlash-style trainer (the demo's, and a template for the real one).

A frozen target model (read from the staged model directory, e.g. /dev/shm/demo-target) runs
forward only; a small drafter learns to predict the next ``--block-size`` tokens from the
target's last hidden state at an anchor position. Token shards come from ``--data-dir``:
``*.tokens`` (uint32 little-endian token ids) with ``*.docs`` (uint32 document lengths);
documents are packed into sequences and no predicted block crosses a document boundary.

Logs one line per ``--log-interval`` steps in a steady format::

    step 20 loss 4.1021 tok/s 18234 lr 3.0e-03 elapsed 4.1s

checkpoints to ``--output-dir/ckpt-last.pt`` (temporary name, then rename) and resumes from it.
On a GPU with ``--target fla`` the target's mixing layers are FLA Gated DeltaNet layers and
``--dp-replicas N`` runs N data-parallel target replicas from threads (use dfo's autotune guard
and sequential warmup: ``run.autotune_guard: true``).

``--dp-pairs N`` is the seed run's shape: N data-parallel pairs of 2 devices each. Pair i holds
its own copy of the frozen target on its first device (cuda:2i) and its own drafter copy on its
second (cuda:2i+1); every pair's step (target forward, then drafter forward and backward) runs
in a ThreadPoolExecutor thread, one per pair. The drafters' gradients are averaged on pair 0's
drafter device, pair 0's optimizer steps, and the new weights are copied to the other drafters,
so all drafters stay equal. 4 GPUs = 2 pairs; with fewer GPUs devices are shared (on one GPU
everything sits on cuda:0), and on a CPU every pair runs on "cpu" (threads all the same).

Under torchrun (``WORLD_SIZE`` > 1 in the environment) it trains data-parallel with
DistributedDataParallel: one process per device (cuda:LOCAL_RANK with NCCL, or the CPU with gloo),
each with its own copy of the frozen target and its own batches; every rank logs the same
all-reduced loss, rank 0 saves the checkpoint, and every rank resumes from rank 0's checkpoint.
``--exit-at-step N --exit-rank R`` makes rank R exit 1 at step N (to test how a gang fails).

A planned stop loses no step: on SIGTERM (``dfo stop``, a preemption notice) the step in progress
finishes, the checkpoint is saved at that step, and the trainer exits 0 saying
``stopping at step N on SIGTERM``; under torchrun every rank stops after the same step (the ranks
agree on it with one all-reduce of a flag per step) and rank 0 saves. The outputs shipper's last
pass then sends that checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import glob
import json
import math
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------- data
def say(line: str) -> None:
    """One log line in one write. dfo launches the trainer with PYTHONUNBUFFERED=1, where print() writes the
    text and its newline separately: the ranks of a DDP run, sharing one log, would glue their lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def load_shards(data_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All tokens, and the document id of every token, from the shards in ``data_dir``."""
    toks, docs = [], []
    doc_base = 0
    paths = sorted(glob.glob(os.path.join(data_dir, "*.tokens")))
    if not paths:
        sys.exit(f"no *.tokens shards in {data_dir}")
    for p in paths:
        with open(p, "rb") as f:
            t = torch.frombuffer(bytearray(f.read()), dtype=torch.int32).long()
        with open(p[: -len(".tokens")] + ".docs", "rb") as f:
            lens = torch.frombuffer(bytearray(f.read()), dtype=torch.int32).long()
        if int(lens.sum()) != t.numel():
            sys.exit(f"{p}: document lengths add up to {int(lens.sum())}, shard has {t.numel()} tokens")
        ids = torch.repeat_interleave(torch.arange(doc_base, doc_base + lens.numel()), lens)
        doc_base += lens.numel()
        toks.append(t)
        docs.append(ids)
    return torch.cat(toks), torch.cat(docs)


def batches(tokens: torch.Tensor, doc_ids: torch.Tensor, seq_len: int, batch: int, block: int, gen: torch.Generator):
    """Yield (inputs, doc_ids, anchor mask) of packed sequences; an anchor's block stays in its document."""
    n_seq = (tokens.numel() - 1) // seq_len
    while True:
        order = torch.randperm(n_seq, generator=gen)
        for i in range(0, n_seq - batch + 1, batch):
            idx = order[i:i + batch, None] * seq_len + torch.arange(seq_len)
            x, d = tokens[idx], doc_ids[idx]
            valid = torch.zeros_like(x, dtype=torch.bool)
            valid[:, :-block] = d[:, :-block] == d[:, block:]   # same document from anchor to block end
            yield x, valid


# --------------------------------------------------------------------------- models
class Block(nn.Module):
    def __init__(self, d: int, heads: int, kind: str, idx: int = 0) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.kind, self.heads = kind, heads
        if kind == "fla":
            from fla.layers import GatedDeltaNet  # GPU only

            self.mix = GatedDeltaNet(hidden_size=d, num_heads=heads, head_dim=d // heads, expand_v=1.0, mode="chunk",
                                     use_short_conv=True, use_gate=True, layer_idx=idx)
        else:
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n1(x)
        if self.kind == "fla":
            h = self.mix(h)[0]
        else:
            b, t, d = h.shape
            q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            h = self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        x = x + h
        return x + self.mlp(self.n2(x))


class Target(nn.Module):
    def __init__(self, cfg: dict, kind: str) -> None:
        super().__init__()
        d = cfg["d_model"]
        self.emb = nn.Embedding(cfg["vocab"], d)
        self.blocks = nn.ModuleList(Block(d, cfg["n_heads"], kind, i) for i in range(cfg["n_layers"]))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h)
        return self.norm(h)


def load_target(model_dir: str, kind: str) -> tuple[Target, dict]:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    model = Target(cfg, kind)
    with open(os.path.join(model_dir, "model.bin"), "rb") as f:
        flat = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    state, off = {}, 0
    for name, shape in cfg["params"]:
        n = math.prod(shape)
        state[name] = flat[off:off + n].view(shape)
        off += n
    if off != flat.numel():
        sys.exit(f"{model_dir}/model.bin holds {flat.numel()} floats, config.json describes {off}")
    missing = model.load_state_dict(state, strict=(kind != "fla"))
    if kind == "fla":
        say(f"target: FLA mixing layers initialised from seed ({len(missing.missing_keys)} tensors)")
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), cfg


class Drafter(nn.Module):
    """Predicts tokens t+1..t+B from the target's hidden state at anchor t."""

    def __init__(self, d: int, vocab: int, block: int, width: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(block, d) * 0.02)
        self.net = nn.Sequential(nn.Linear(d, width), nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, vocab)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: (N, d) -> (N, B, vocab)
        return self.head(self.net(h[:, None, :] + self.pos[None]))


# --------------------------------------------------------------------------- training
STOP = threading.Event()  # set by SIGTERM: finish the step, save, exit 0


def stop_requested(step: int, rank: int | None = None) -> bool:
    """After a step: was a stop asked for? Under torchrun (rank given) every rank learns it at the same step."""
    if rank is None:
        asked = STOP.is_set()
    else:
        import torch.distributed as dist

        flag = torch.tensor([1.0 if STOP.is_set() else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        asked = bool(flag.item())
    if asked:
        say((f"rank {rank}: " if rank is not None else "") + f"stopping at step {step} on SIGTERM")
    return asked


def save(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _on(dev: torch.device):
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def pair_devices(n_pairs: int, device: str) -> list[tuple[torch.device, torch.device]]:
    """(target device, drafter device) of each pair: cuda:2i and cuda:2i+1, wrapped onto the GPUs there are."""
    if not device.startswith("cuda"):
        return [(torch.device("cpu"), torch.device("cpu"))] * n_pairs
    n_gpu = max(1, torch.cuda.device_count())
    if n_gpu < 2 * n_pairs:
        say(f"pairs: {n_pairs} pairs want {2 * n_pairs} GPUs, {n_gpu} visible: devices are shared")
    return [(torch.device(f"cuda:{2 * i % n_gpu}"), torch.device(f"cuda:{(2 * i + 1) % n_gpu}"))
            for i in range(n_pairs)]


def sync_drafters(drafters: list[nn.Module]) -> None:
    """Copy the first (master) drafter's weights into the others."""
    with torch.no_grad():
        for d in drafters[1:]:
            for p, q in zip(d.parameters(), drafters[0].parameters(), strict=True):
                p.copy_(q)


def average_and_step(drafters: list[nn.Module], opt: torch.optim.Optimizer) -> None:
    """The master drafter's grads become the mean over pairs of each parameter's grad (on the master's
    device); the master's optimizer steps; the other drafters get the master's new weights."""
    if len(drafters) > 1:
        for ps in zip(*(d.parameters() for d in drafters), strict=True):
            ps[0].grad = torch.stack([p.grad.to(ps[0].device) for p in ps]).mean(0)
    opt.step()
    sync_drafters(drafters)


def train_pairs(a: argparse.Namespace) -> int:
    """--dp-pairs N: per pair its own target and drafter copy, one thread per pair, drafter grads averaged."""
    torch.manual_seed(a.seed)
    os.makedirs(a.output_dir, exist_ok=True)
    ckpt_path = os.path.join(a.output_dir, "ckpt-last.pt")
    tokens, doc_ids = load_shards(a.data_dir)
    n, pairs = a.dp_pairs, pair_devices(a.dp_pairs, a.device)
    targets = []
    for tdev, _ in pairs:
        t, cfg = load_target(a.target_model, a.target)
        targets.append(t.to(tdev, dtype=torch.bfloat16 if a.target == "fla" else torch.float32))
    base = Drafter(cfg["d_model"], cfg["vocab"], a.block_size, a.width)
    drafters = [copy.deepcopy(base).to(ddev) for _, ddev in pairs]
    master, mdev = drafters[0], pairs[0][1]
    opt = torch.optim.AdamW(master.parameters(), lr=a.lr)
    step, total = 0, 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=mdev)
        master.load_state_dict(ck["drafter"])
        opt.load_state_dict(ck["opt"])
        step, total = ck["step"], ck.get("tokens", 0)
        say(f"resumed from {ckpt_path} at step {step}")

    sync_drafters(drafters)
    per_step = a.batch_size * n * a.seq_len
    say(f"data: {tokens.numel()} tokens, {int(doc_ids[-1]) + 1} documents; target: {cfg['n_layers']} layers "
          f"d={cfg['d_model']} vocab={cfg['vocab']} ({a.target}); pairs: "
          f"{[(str(t), str(d)) for t, d in pairs]}; tokens/step {per_step}")
    gen = torch.Generator().manual_seed(a.seed + step)
    it = batches(tokens, doc_ids, a.seq_len, a.batch_size * n, a.block_size, gen)
    offsets = torch.arange(1, a.block_size + 1)

    def target_forward(i: int, x: torch.Tensor) -> torch.Tensor:
        tdev = pairs[i][0]
        with torch.no_grad(), _on(tdev):
            return targets[i](x.to(tdev))

    def pair_step(i: int, x: torch.Tensor, b_idx: torch.Tensor, t_idx: torch.Tensor, labels: torch.Tensor):
        """One pair's work, in its own thread: target forward, then the drafter's forward and backward."""
        ddev = pairs[i][1]
        hidden = target_forward(i, x)
        with _on(ddev):
            h = hidden[b_idx.to(hidden.device), t_idx.to(hidden.device)].float().to(ddev)
            logits = drafters[i](h)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.to(ddev).reshape(-1))
            loss.backward()
        return loss.detach().to(mdev)

    if a.warmup and a.device.startswith("cuda"):
        sys.path.insert(0, os.environ.get("DFO_AGENT_DIR", ""))
        from remote.gpu.warmup import sequential_warmup  # shipped by dfo on the node

        x0, _ = next(it)
        first = {}
        for i, (tdev, _) in enumerate(pairs):
            first.setdefault(str(tdev), i)   # one warmup per target device (shared devices warm once)
        rep = sequential_warmup({dev: (lambda i=i: target_forward(i, x0[: a.batch_size]))
                                 for dev, i in first.items()})
        say(f"warmup: {json.dumps(rep, default=str)}")
    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="pair")
    t0, seen = time.time(), 0
    while step < a.max_steps:
        x, valid = next(it)
        work = []
        for i, (xc, vc) in enumerate(zip(x.chunk(n), valid.chunk(n), strict=True)):
            b_idx, t_idx = vc.nonzero(as_tuple=True)   # anchors drawn here, in order: the threads use no generator
            if b_idx.numel() > a.max_anchors:
                pick = torch.randperm(b_idx.numel(), generator=gen)[: a.max_anchors]
                b_idx, t_idx = b_idx[pick], t_idx[pick]
            work.append((i, xc, b_idx, t_idx, xc[b_idx[:, None], t_idx[:, None] + offsets]))
        for d in drafters:
            d.zero_grad(set_to_none=True)
        losses = list(pool.map(lambda w: pair_step(*w), work))
        average_and_step(drafters, opt)
        loss = torch.stack(losses).mean()
        step += 1
        seen += x.numel()
        total += x.numel()
        if step % a.log_interval == 0 or step == a.max_steps:
            el = time.time() - t0
            say(f"step {step} loss {loss.item():.4f} tok/s {seen / max(el, 1e-9):.0f} lr {a.lr:.1e} "
                  f"elapsed {el:.1f}s")
        stopping = stop_requested(step)
        if step % a.save_interval == 0 or step == a.max_steps or stopping:
            save(ckpt_path, {"drafter": master.state_dict(), "opt": opt.state_dict(), "step": step,
                             "tokens": total, "dp_pairs": n})
        if stopping:
            break
    pool.shutdown()
    say(f"done: {step} steps, {total} tokens, checkpoint {ckpt_path}")
    return 0


def train_ddp(a: argparse.Namespace) -> int:
    """One rank of a torchrun gang: the drafter in DDP, the loss all-reduced, rank 0 checkpoints."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = a.device.startswith("cuda") and torch.cuda.is_available()
    dev = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=a.dist_timeout),
                            device_id=dev if cuda else None)
    torch.manual_seed(a.seed)  # the same initial drafter everywhere (DDP also broadcasts rank 0's)
    ckpt_path = os.path.join(a.output_dir, "ckpt-last.pt")
    tokens, doc_ids = load_shards(a.data_dir)
    target, cfg = load_target(a.target_model, a.target)
    target = target.to(dev, dtype=torch.bfloat16 if a.target == "fla" else torch.float32)
    drafter = Drafter(cfg["d_model"], cfg["vocab"], a.block_size, a.width).to(dev)
    opt = torch.optim.AdamW(drafter.parameters(), lr=a.lr)
    step, box = 0, [None]
    if rank == 0 and os.path.exists(ckpt_path):
        box[0] = torch.load(ckpt_path, map_location="cpu")
    dist.broadcast_object_list(box, src=0)  # every rank resumes from rank 0's checkpoint
    if box[0] is not None:
        drafter.load_state_dict(box[0]["drafter"])
        opt.load_state_dict(box[0]["opt"])
        step = box[0]["step"]
        say(f"rank {rank}: resumed from {ckpt_path} at step {step}")
    model = DistributedDataParallel(drafter, device_ids=[local] if cuda else None)
    say(f"ddp: rank {rank} of {world}, local rank {local}, node {os.environ.get('GROUP_RANK', '?')}, "
          f"device {dev}, backend {backend}; data: {tokens.numel()} tokens")
    gen = torch.Generator().manual_seed(a.seed + 1000003 * rank + step)  # each rank its own batches
    it = batches(tokens, doc_ids, a.seq_len, a.batch_size, a.block_size, gen)
    offsets = torch.arange(1, a.block_size + 1)
    t0, seen = time.time(), 0
    while step < a.max_steps:
        x, valid = next(it)
        with torch.no_grad():
            hidden = target(x.to(dev)).float()
        b_idx, t_idx = valid.nonzero(as_tuple=True)
        if b_idx.numel() > a.max_anchors:
            pick = torch.randperm(b_idx.numel(), generator=gen)[: a.max_anchors]
            b_idx, t_idx = b_idx[pick], t_idx[pick]
        labels = x[b_idx[:, None], t_idx[:, None] + offsets].to(dev)
        logits = model(hidden[b_idx.to(dev), t_idx.to(dev)])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over the ranks here
        opt.step()
        step += 1
        seen += x.numel() * world
        if a.exit_at_step and step == a.exit_at_step and rank == a.exit_rank:
            say(f"rank {rank}: exiting with 1 at step {step} (--exit-at-step)")
            os._exit(1)
        if step % a.log_interval == 0 or step == a.max_steps:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean /= world
            el = time.time() - t0
            say(f"rank {rank}: step {step} loss {mean.item():.4f} (all-reduced over {world} ranks) "
                  f"tok/s {seen / max(el, 1e-9):.0f} elapsed {el:.1f}s")
        stopping = stop_requested(step, rank)
        if rank == 0 and (step % a.save_interval == 0 or step == a.max_steps or stopping):
            save(ckpt_path, {"drafter": drafter.state_dict(), "opt": opt.state_dict(), "step": step})
        if stopping:
            break
    dist.barrier()
    dist.destroy_process_group()
    say(f"rank {rank}: done: {step} steps" + (f", checkpoint {ckpt_path}" if rank == 0 else ""))
    # leave without the interpreter's teardown: a rank whose gloo threads were still being torn down there was
    # killed by SIGABRT after its last line, once in a CI run on a loaded 2-core machine (torchrun then failed)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-model", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--target", choices=["plain", "fla"], default="plain")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dp-replicas", type=int, default=1, help="target replicas run from threads (one per GPU)")
    ap.add_argument("--dp-pairs", type=int, default=0,
                    help="N data-parallel pairs (target on cuda:2i, drafter on cuda:2i+1), one thread each")
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--max-anchors", type=int, default=512)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--save-interval", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", action="store_true", help="sequential warmup of every replica before threads start")
    ap.add_argument("--dist-timeout", type=float, default=1800, help="torch.distributed collective timeout (s)")
    ap.add_argument("--exit-at-step", type=int, default=0, help="under torchrun: --exit-rank exits 1 at this step")
    ap.add_argument("--exit-rank", type=int, default=0)
    a = ap.parse_args(argv)
    os.makedirs(a.output_dir, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: STOP.set())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if a.dp_pairs or a.dp_replicas > 1:
            ap.error("under torchrun each rank is one device: drop --dp-pairs / --dp-replicas")
        return train_ddp(a)
    if a.dp_pairs < 0 or (a.dp_pairs and a.dp_replicas > 1):
        ap.error("--dp-pairs takes N >= 1 and does not combine with --dp-replicas")
    if a.dp_pairs:
        return train_pairs(a)

    torch.manual_seed(a.seed)
    os.makedirs(a.output_dir, exist_ok=True)
    ckpt_path = os.path.join(a.output_dir, "ckpt-last.pt")
    tokens, doc_ids = load_shards(a.data_dir)
    n_dev = max(1, a.dp_replicas)
    devices = ([f"cuda:{i % max(1, torch.cuda.device_count())}" for i in range(n_dev)]
               if a.device.startswith("cuda") else ["cpu"] * n_dev)
    targets = []
    for dev in devices:
        t, cfg = load_target(a.target_model, a.target)
        targets.append(t.to(dev, dtype=torch.bfloat16 if a.target == "fla" else torch.float32))
    drafter = Drafter(cfg["d_model"], cfg["vocab"], a.block_size, a.width).to(devices[0])
    opt = torch.optim.AdamW(drafter.parameters(), lr=a.lr)
    step = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=devices[0])
        drafter.load_state_dict(ck["drafter"])
        opt.load_state_dict(ck["opt"])
        step = ck["step"]
        say(f"resumed from {ckpt_path} at step {step}")
    say(f"data: {tokens.numel()} tokens, {int(doc_ids[-1]) + 1} documents; target: {cfg['n_layers']} layers "
          f"d={cfg['d_model']} vocab={cfg['vocab']} ({a.target}); replicas: {devices}")
    gen = torch.Generator().manual_seed(a.seed + step)
    it = batches(tokens, doc_ids, a.seq_len, a.batch_size * n_dev, a.block_size, gen)
    offsets = torch.arange(1, a.block_size + 1)

    def target_forward(i: int, x: torch.Tensor) -> torch.Tensor:
        dev = torch.device(devices[i])
        with torch.no_grad(), (torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()):
            return targets[i](x.to(dev)).float().to(devices[0])

    if a.warmup and n_dev > 1:
        sys.path.insert(0, os.environ.get("DFO_AGENT_DIR", ""))
        from remote.gpu.warmup import sequential_warmup  # shipped by dfo on the node

        x0, _ = next(it)
        rep = sequential_warmup({devices[i]: (lambda i=i: target_forward(i, x0[: a.batch_size])) for i in range(n_dev)})
        say(f"warmup: {json.dumps(rep, default=str)}")
    pool = ThreadPoolExecutor(max_workers=n_dev) if n_dev > 1 else None
    t0, seen = time.time(), 0
    while step < a.max_steps:
        x, valid = next(it)
        chunks = x.chunk(n_dev)
        if pool is not None:
            hidden = torch.cat(list(pool.map(target_forward, range(n_dev), chunks)))
        else:
            hidden = target_forward(0, x)
        b_idx, t_idx = valid.nonzero(as_tuple=True)
        if b_idx.numel() > a.max_anchors:
            pick = torch.randperm(b_idx.numel(), generator=gen)[: a.max_anchors]
            b_idx, t_idx = b_idx[pick], t_idx[pick]
        labels = x[b_idx[:, None], t_idx[:, None] + offsets].to(devices[0])
        logits = drafter(hidden[b_idx, t_idx])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        seen += x.numel()
        if step % a.log_interval == 0 or step == a.max_steps:
            el = time.time() - t0
            say(f"step {step} loss {loss.item():.4f} tok/s {seen / max(el, 1e-9):.0f} lr {a.lr:.1e} "
                  f"elapsed {el:.1f}s")
        stopping = stop_requested(step)
        if step % a.save_interval == 0 or step == a.max_steps or stopping:
            save(ckpt_path, {"drafter": drafter.state_dict(), "opt": opt.state_dict(), "step": step})
        if stopping:
            break
    say(f"done: {step} steps, checkpoint {ckpt_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
