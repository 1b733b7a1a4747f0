"""Self-distillation speed on a GPU: eager batched decoding vs CUDA-graph buckets, same prompts, same run.

    python benchmarks/bench_distill_gpu.py                         # the embedded model's shape, random weights
    python benchmarks/bench_distill_gpu.py --model default --prompts 256 --batch-size 128

``specdec train-medusa`` / ``train-eagle`` spend most of a GPU run decoding the target's own answers
(:func:`specdec.train.distill.self_distill`); ``--distill-cuda-graphs auto`` (the default) replays each decode step
as a CUDA graph. This times ``self_distill`` both ways (eager first, then graphs; each after an untimed warm-up of
its own on the same batch size, so Triton's kernel compilation is left out and graph capture is counted, as a user
pays it), greedy, bf16, into an empty cache, and prints tokens/s, the ratio, and how many of the sequences are the
same token for token (bf16 rounds differently in a padded bucket, so near-ties may part). The default model is the
embedded model's shape (30 layers, 576 wide, GQA 9/3, vocabulary 49,152) with random weights: the speed of a real
checkpoint of that shape, without sending its file. Refuses to run without CUDA (exit status 2).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_overwrite, check_new_files  # noqa: E402

from specdec.atomic_write import write_json  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shape",
                    help="'shape': random weights in the embedded model's shape (default); else an alias or path")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    check_new_files(ap, args.overwrite, args.json)
    return args


def load(spec: str):
    from specdec.models.loader import load_model

    if spec != "shape":
        return load_model(spec, dtype=torch.bfloat16, device="cuda")
    from specdec.testing import build_tiny_model

    model = build_tiny_model("llama-gqa-tied", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                             max_position_embeddings=8192)
    return load_model(model.to(device="cuda", dtype=torch.bfloat16))


def prompts_for(loaded, n: int) -> list[list[int]]:
    if loaded.tokenizer is not None:
        from specdec.train.distill import encode_prompt
        from specdec.train.prompts import builtin_prompts

        return [encode_prompt(loaded.tokenizer, p) for p in builtin_prompts(n)]
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, 49152, (16 + i % 48,), generator=gen).tolist() for i in range(n)]


def timed(loaded, prompts, args, graphs: bool) -> tuple[float, list[list[int]]]:
    from specdec.train.distill import self_distill

    with tempfile.TemporaryDirectory() as cache:
        self_distill(loaded, prompts[: args.batch_size], max_new_tokens=8, batch_size=args.batch_size,
                     cache_dir=cache, progress=False, cuda_graphs=graphs)  # warm-up: Triton compiles here
    with tempfile.TemporaryDirectory() as cache:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self_distill(loaded, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                           cache_dir=cache, progress=False, cuda_graphs=graphs)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_distill_gpu: needs a CUDA GPU (times self-distillation on one)", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    loaded = load(args.model)
    prompts = prompts_for(loaded, args.prompts)
    new = {}
    results = {}
    for name, graphs in (("eager", False), ("graphs", True)):
        seconds, out = timed(loaded, prompts, args, graphs)
        tokens = sum(len(s) - len(p) for s, p in zip(out, prompts, strict=True))
        new[name] = [s[len(p):] for s, p in zip(out, prompts, strict=True)]
        results[name] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
        print(f"{name:7s} {seconds:7.2f} s  {tokens:7d} tokens  {tokens / seconds:9.0f} tok/s", flush=True)
    same = sum(a == b for a, b in zip(new["eager"], new["graphs"], strict=True))
    ratio = results["graphs"]["tokens_per_s"] / results["eager"]["tokens_per_s"]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model}, bf16, {args.prompts} prompts "
          f"x {args.max_new_tokens} tokens, batch {args.batch_size}: graphs / eager = {ratio:.2f}x; "
          f"{same}/{len(prompts)} sequences the same token for token")
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results, "ratio": ratio, "same_sequences": same,
                               "device": torch.cuda.get_device_name()}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
