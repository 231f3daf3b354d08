#!/usr/bin/env python3
"""Fuzz the converter's checkpoint readers (py/locret/convert/checkpoint.py) with a seeded mutation loop.

    .venv/bin/python scripts/fuzz_checkpoints.py [--inputs 100000] [--seed 0] [--kinds safetensors,torch,index]

Seeds: small retaining-head checkpoints made here (a trainer-style .safetensors with __metadata__, a torch.save
.pt, a sharded Hugging Face directory with its index, and a heads GGUF as the converter writes it, read back by
`locret train --init-heads heads.gguf`). Each input is a seed with one or more mutations:
truncation, flipped bits, boundary values written over integers of the header (safetensors' header length, JSON
numbers: shapes, offsets), inserted and removed bytes, and for the index file damaged JSON. Each input is read with
read_checkpoint and every head tensor loaded; the outcome must be a checkpoint or a ConversionError (the converter's
clear refusal): any other exception, or an input taking longer than --timeout seconds, is a failure, printed with the
mutation that made it (re-run with --seed and --inputs to reproduce). Exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "py"))

KINDS = ("safetensors", "torch", "index", "gguf")
BOUNDARY_U64 = (0, 1, 7, 8, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF)
BOUNDARY_NUMBERS = (b"0", b"-1", b"1", b"4294967295", b"18446744073709551615", b"99999999999999999999999", b"1e308")


class Timeout(Exception):
    pass


def seed_tensors():
    import torch

    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(2):
        out[f"model.layers.{layer}.self_attn.fc1.weight"] = torch.randn(8, 12, generator=g).to(torch.bfloat16)
        out[f"model.layers.{layer}.self_attn.fc1.bias"] = torch.randn(8, generator=g)
        out[f"model.layers.{layer}.self_attn.fc2.weight"] = torch.randn(2, 8, generator=g).to(torch.float16)
    out["model.embed_tokens.weight"] = torch.randn(4, 4, generator=g)  # not a head tensor: skipped by the reader
    return out


def make_seeds(work: Path) -> dict[str, tuple[Path, bytes]]:
    """kind -> (the file a mutation replaces, its original bytes); the index kind's shards stay intact."""
    import torch
    from safetensors.torch import save_file

    tensors = seed_tensors()
    st = work / "seed.safetensors"
    save_file(tensors, str(st), metadata={"locret.training.seed": "3", "locret.training.steps": "10",
                                         "locret.training.notes": "fuzz seed"})
    pt = work / "seed.pt"
    torch.save(tensors, pt)
    shard_dir = work / "sharded"
    shard_dir.mkdir()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(shard_dir / shard))
        weight_map.update({n: shard for n in part})
    index = shard_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    gguf = write_gguf_seed(tensors, work / "seed.gguf")
    return {"safetensors": (st, st.read_bytes()), "torch": (pt, pt.read_bytes()), "index": (index, index.read_bytes()),
            "gguf": (gguf, gguf.read_bytes())}


def write_gguf_seed(tensors, out: Path) -> Path:
    """The seed tensors written as the converter writes heads, for a llama-shaped base whose sizes fit them
    (2 layers, 2 query and 2 KV heads of size 2: d_in 12; W1's Q/K columns permuted; F16 weights, F32 biases)."""
    from locret.convert.architectures import architecture
    from locret.convert.base_model import BaseModel
    from locret.convert.gguf_output import Recommended, encode_layer, heads_key_values, write_standalone
    from locret.convert.heads import HeadsLayout, LayerHead
    from locret.convert.permutation import llama_cpp_input_order
    from gguf import GGMLQuantizationType

    base = BaseModel(path=out, architecture="llama", name="fuzz", n_layer=2, n_head=2, n_head_kv=2, head_dim_k=2,
                     head_dim_v=2)
    order = llama_cpp_input_order(base.n_head, base.n_head_kv, base.head_dim_k, base.head_dim_v)
    f16 = {"fc1": GGMLQuantizationType.F16, "fc2": GGMLQuantizationType.F16}
    encoded = []
    for layer in range(base.n_layer):
        get = lambda fc, kind: tensors[f"model.layers.{layer}.self_attn.{fc}.{kind}"].float().numpy()
        head = LayerHead(fc1_weight=get("fc1", "weight")[:, order], fc2_weight=get("fc2", "weight"),
                         fc1_bias=get("fc1", "bias"), fc2_bias=None)
        encoded += encode_layer(layer, head, f16)
    layout = HeadsLayout(d_r=8, has_fc1_bias=True, has_fc2_bias=False)
    kvs = heads_key_values(base, architecture("llama"), layout, True, Recommended(64, 32, 8, 4),
                           {"locret.training.seed": 3, "locret.training.notes": "fuzz seed"})
    write_standalone(out, base, "fuzz seed heads", kvs, encoded)
    return out


def mutate(data: bytes, kind: str, rng: random.Random) -> tuple[bytes, list[str]]:
    """One to three mutations of `data`; returns the bytes and what was done."""
    buf = bytearray(data)
    done = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        op = rng.choice(("truncate", "flip", "boundary", "insert", "remove", "number"))
        if not buf:
            break
        if op == "truncate":
            at = rng.randrange(len(buf))
            del buf[at:]
            done.append(f"truncate@{at}")
        elif op == "flip":
            # mostly in the header, where the structure is
            end = len(buf) if rng.random() < 0.3 else min(len(buf), 400)
            for _ in range(rng.randint(1, 8)):
                at = rng.randrange(end)
                buf[at] ^= 1 << rng.randrange(8)
            done.append("flip")
        elif op == "boundary":
            value = rng.choice(BOUNDARY_U64)
            at = 0 if kind == "safetensors" and rng.random() < 0.5 else rng.randrange(max(1, min(len(buf), 400) - 8))
            buf[at:at + 8] = struct.pack("<Q", value)
            done.append(f"u64@{at}={value:#x}")
        elif op == "insert":
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            done.append(f"insert@{at}")
        elif op == "remove":
            at = rng.randrange(len(buf))
            del buf[at:at + rng.randint(1, 16)]
            done.append(f"remove@{at}")
        else:
            # a JSON number of the header (shapes, offsets) replaced by a boundary value
            header = bytes(buf[:2000])
            starts = [i for i in range(1, len(header)) if chr(header[i]).isdigit() and not chr(header[i - 1]).isdigit()]
            if not starts:
                continue
            at = rng.choice(starts)
            end = at
            while end < len(buf) and chr(buf[end]).isdigit():
                end += 1
            new = rng.choice(BOUNDARY_NUMBERS)
            buf[at:end] = new
            done.append(f"number@{at}={new.decode()}")
    return bytes(buf), done


def read_all(path: Path) -> int:
    """read_checkpoint and load every head tensor; the number of tensors read"""
    from locret.convert.checkpoint import read_checkpoint

    checkpoint = read_checkpoint(path)
    for name in checkpoint.shapes:
        checkpoint.load(name)
    return len(checkpoint.shapes)


def run(n_inputs: int, seed: int, kinds: list[str], timeout: float, progress: bool = True) -> dict:
    import locret.convert.checkpoint as checkpoint_module
    from locret.convert.errors import ConversionError

    stats = {"inputs": 0, "loaded": 0, "refused": 0, "failures": []}
    # the reader's notes (ignored metadata entries) are for people converting one file, not for a million
    saved_note, checkpoint_module.note = checkpoint_module.note, lambda message: None
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="locret-fuzz-", dir=root) as tmp:
        work = Path(tmp)
        seeds = make_seeds(work)
        for kind in kinds:  # every seed reads cleanly before it is mutated
            assert read_all(seeds[kind][0] if kind != "index" else seeds[kind][0].parent) > 0, kind

        def on_alarm(signum, frame):
            raise Timeout()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=n_inputs, unit="input", desc="fuzz", mininterval=2.0)
        try:
            for i in range(n_inputs):
                rng = random.Random(f"{seed}:{i}")
                kind = kinds[i % len(kinds)]
                target, original = seeds[kind]
                data, how = mutate(original, kind, rng)
                target.write_bytes(data)
                path = target.parent if kind == "index" else target
                signal.setitimer(signal.ITIMER_REAL, timeout)
                try:
                    read_all(path)
                    stats["loaded"] += 1
                except ConversionError as e:
                    if not str(e).strip():
                        stats["failures"].append((i, kind, how, "ConversionError without a message"))
                    stats["refused"] += 1
                except Timeout:
                    stats["failures"].append((i, kind, how, f"took more than {timeout} s"))
                except Exception as e:  # noqa: BLE001 (anything but the converter's refusal is a defect)
                    stats["failures"].append((i, kind, how, f"{type(e).__name__}: {e}"[:300]))
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    target.write_bytes(original)
                stats["inputs"] += 1
                if bar is not None:
                    bar.update(1)
        finally:
            signal.signal(signal.SIGALRM, previous)
            checkpoint_module.note = saved_note
            if bar is not None:
                bar.close()
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=100_000, help="mutated inputs in all (default 100000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds one input may take (default 10)")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds) or args.inputs < 1:
        print(f"fuzz_checkpoints: error: --kinds must name some of {', '.join(KINDS)} and --inputs be positive",
              file=sys.stderr)
        return 2
    t0 = time.time()
    stats = run(args.inputs, args.seed, kinds, args.timeout)
    print(f"{stats['inputs']} inputs ({', '.join(kinds)}, seed {args.seed}) in {time.time() - t0:.0f} s: "
          f"{stats['loaded']} loaded, {stats['refused']} refused with a ConversionError, "
          f"{len(stats['failures'])} failures")
    for i, kind, how, what in stats["failures"][:50]:
        print(f"  input {i} ({kind}, {' '.join(how)}): {what}")
    return 1 if stats["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
