"""GPU speed at real model sizes: synthetic targets of published shapes and the embedded model, one report.

    python benchmarks/bench_speed_gpu.py --out gpu-report            # on a GPU (gpu_check.py --steps speed)
    python benchmarks/bench_speed_gpu.py --rehearse --out /tmp/r     # the whole thing on the CPU, tiny shapes

Per model (docs/gpu-speed.md explains every column):

* plain decoding at batch 1, 8 and 32: decode tokens/s (prefill excluded) against the weight-read floor (weight
  bytes / the device-to-device copy bandwidth measured in the same run, one weight read per step); at batch 1 also
  with each step read before the next is launched, what queuing steps ahead saves (specdec/decode_ahead.py);
* the verify-cost curve c(n) / c(1), n = 1..65 query tokens of one sequence, as the engine runs it (graphed), and
  beside it the products alone over n rows (benchmarks/products_curve.py; also past 65, what padding would cost; on
  CUDA also under cuBLASLt): how much of c(n), and of the step's distance to the floor, the products make;
* the oracle drafter (``specdec.eval.oracle_drafter``) at tau 2, 3 and 4, as a chain and as a tree, paying a
  random EAGLE layer's real drafting each step: speedup over specdec's plain decoding at the same batch;
* transformers' ``generate()`` with its static cache (eager, batch 1) as the same-run baseline, where it fits the
  budget;
* a profile of batch-1 plain decoding, of the oracle chain at the first tau with EAGLE's drafting, replayed
  and eager, and of the oracle's 64-node tree (each step a 65-token verify) (benchmarks/step_profile.py): GPU busy
  and idle time per step, kernel time by kind (products, attention, norms), the kernels of each engine phase (graph
  replays included), graph and host launches and the ops issuing them (eager: each op's kernels), host waits on the
  device and the engine's phases on the host, so that a number that misses its goal says why; then that chain
  with replayed drafting once more under ``cProfile`` (the host's Python functions by their time per step); last,
  the profile of plain decoding and the oracle chain under ``speculation="auto"`` at the largest batch (the batch
  goal's row).

Models run in order of importance, each within its share of ``--budget`` seconds; whatever does not fit is marked
skipped in the report instead of overrunning, so the run ends in time; ``item_seconds`` says what each took.
``report`` JSON + Markdown are rewritten after every measurement, so a killed run keeps what it measured. Exit
status 0 also when items were skipped.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HelpWithDefaults, add_overwrite, check_new_files, run_main  # noqa: E402
from products_curve import blas_library, product_bytes, products_ms  # noqa: E402
from step_profile import host_python, host_python_lines, markdown_rows, profiled  # noqa: E402

from specdec.atomic_write import write_json, write_text  # noqa: E402

FULL_MODELS = ("synthetic:llama-3.1-8b", "default", "synthetic:qwen3-1.7b", "synthetic:llama-3.2-1b")
EMBEDDED_SHAPE = "synthetic:smollm2-135m"  # the embedded model's shape: its speed where its GGUF is not at hand
# the first model's budget share, against each later model's 1: the 8B shape, four of the goals' rows (the embedded
# model, next, needs only its plain row; a model's unspent share passes to the next)
FIRST_MODEL_WEIGHT = 3.0
REHEARSAL_MODELS = ("synthetic:llama-3.1-8b@tiny", "synthetic:qwen3-1.7b@tiny", "synthetic:llama-3.2-1b@tiny")
TAUS = (3.0, 2.0, 4.0)  # tau 3 first: the one the goals name
CHAIN_DEPTH = 6
SHORT_CHAIN_DEPTH = 4  # the same tau from fewer, likelier levels: less drafting per step (EAGLE's depth is its own)
PROFILE_TOKENS = 32  # new tokens per profiled call (the trace's size)
TREE_DEPTH, TREE_WIDTH = 8, 8  # 64 nodes: the largest tree a step verifies
# rows of the products-alone curve: the verify curve's reported sizes, and past 65 the row counts a 65-token verify
# could be padded to
PRODUCT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 65, 72, 80, 96, 128)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--out", default="gpu-report", help="directory of speed.json / speed.md (created)")
    ap.add_argument("--rehearse", action="store_true",
                    help="CPU, tiny shapes, few tokens: checks the whole command in well under a minute")
    ap.add_argument("--models", default=None, help="comma-separated (synthetic:NAME[@tiny], default, a path)")
    ap.add_argument("--embedded", default="default",
                    help="what 'default' in the model list loads: the alias, or the embedded GGUF's path; where it "
                         f"cannot be loaded, {EMBEDDED_SHAPE} (its shape, random weights) stands in")
    ap.add_argument("--batches", default=None, help="default 1,8,32; rehearsal 1,2,4")
    ap.add_argument("--taus", default=",".join(str(t) for t in TAUS))
    ap.add_argument("--sizes", default=None,
                    help="verify-cost query sizes: 'A-B' or a comma list (default 1-65: up to the root and a 64-node "
                         "tree; rehearsal 1,2,4,8,16,32,64,65)")
    ap.add_argument("--new-tokens", type=int, default=None, help="per sequence (default 128; rehearsal 8)")
    ap.add_argument("--prompt-len", type=int, default=None, help="random prompt tokens (default 128; rehearsal 8)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for everything (default 400; rehearsal 50)")
    ap.add_argument("--no-hf", action="store_true", help="leave out transformers' static-cache baseline")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    check_new_files(ap, args.overwrite, Path(args.out) / "speed.json", Path(args.out) / "speed.md")
    args.models = args.models.split(",") if args.models else list(REHEARSAL_MODELS if args.rehearse else FULL_MODELS)
    args.batches = [int(b) for b in (args.batches or ("1,2,4" if args.rehearse else "1,8,32")).split(",")]
    args.sizes = args.sizes or ("1,2,4,8,16,32,64,65" if args.rehearse else "1-65")
    args.taus = [float(t) for t in args.taus.split(",")]
    if "-" in args.sizes:
        lo, hi = (int(x) for x in args.sizes.split("-"))
        args.sizes = list(range(lo, hi + 1))
    else:
        args.sizes = [int(n) for n in args.sizes.split(",")]
    args.new_tokens = args.new_tokens or (8 if args.rehearse else 128)
    args.prompt_len = args.prompt_len or (8 if args.rehearse else 128)
    args.budget = args.budget or (50.0 if args.rehearse else 400.0)
    return args


class Clock:
    """The run's deadline and each model's share of what is left."""

    def __init__(self, budget: float) -> None:
        self.end = time.perf_counter() + budget
        self.share_end = self.end

    def start_share(self, models_left: int, weight: float = 1.0) -> None:
        """A model's share of what is left: ``weight`` to each later model's 1."""
        left = max(0.0, self.end - time.perf_counter())
        self.share_end = time.perf_counter() + left * weight / (weight + max(models_left, 1) - 1)

    def allows(self) -> bool:
        return time.perf_counter() < self.share_end

    def share_left(self) -> float:
        return self.share_end - time.perf_counter()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def launch_times(replay, wait, repeats: int = 20) -> dict:
    """Median ms of ``replay()`` returning to the host (the launch) and of it with ``wait()`` after it (the replay),
    each call after a ``wait()``: an idle device, as a drafted step's verify finds it."""
    launch, whole = [], []
    for _ in range(repeats):
        wait()
        t0 = time.perf_counter()
        replay()
        t1 = time.perf_counter()
        wait()
        launch.append(t1 - t0)
        whole.append(time.perf_counter() - t0)
    return dict(launch_ms=1e3 * statistics.median(launch), replay_ms=1e3 * statistics.median(whole))


def copy_bandwidth(device: torch.device, rehearse: bool) -> float:
    """Bytes/s a device-to-device copy moves (read + write), median of 10: a bound on reading weights."""
    n = (64 if rehearse else 1024) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(11):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times)


def weight_bytes(model) -> int:
    """Bytes one decode step reads: every distinct parameter once, but of an input embedding that is no LM head only
    the rows it gathers (nothing, next to the rest); a tied one is read whole, as the LM head."""
    embed = model.get_input_embeddings().weight
    seen, total = set(), 0
    if embed.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        seen.add(embed.data_ptr())
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def load(spec: str, embedded: str, device: torch.device, dtype: torch.dtype):
    """The model and a note: the embedded model (``embedded``) for "default", its shape where it cannot load."""
    from specdec.models.loader import load_model

    if spec != "default":
        return load_model(spec, device=device, dtype=dtype), None
    try:
        return load_model(embedded, device=device, dtype=dtype), None
    except (OSError, ImportError, ValueError) as err:
        note = f"{embedded!r} did not load ({type(err).__name__}: {' '.join(str(err).split())[:200]}): {EMBEDDED_SHAPE}"
        return load_model(EMBEDDED_SHAPE, device=device, dtype=dtype), note


def run_generate(loaded, prompts, new_tokens: int, **kwargs) -> dict:
    """One timed generate(): decode tokens/s excludes the prefill, which runs each prompt but its last token: every
    new token comes from a step."""
    from specdec.generate import generate

    sync(loaded.runner.device)
    with queued_launches() as queued:
        out = generate(loaded, prompts, max_new_tokens=new_tokens, return_dict=True, eos_token_id=[], **kwargs)
    new = sum(len(t) for t in out.new_tokens)
    decode = out.seconds - out.prefill_seconds
    steps = max(out.forward_passes, 1)
    nodes = [n for st in out.stats for n in st.step_nodes]  # draft nodes each sequence-step verified, after sizing
    return dict(new_tokens=new, seconds=out.seconds, prefill_seconds=out.prefill_seconds,
                decode_tokens_per_s=new / decode if decode > 0 else None, steps=steps,
                step_ms=1e3 * decode / steps, tau=statistics.mean(s.tau for s in out.stats),
                draft_seconds=out.draft_seconds, verified_nodes=statistics.mean(nodes) if nodes else 0.0,
                drafted_share=sum(n > 0 for n in nodes) / len(nodes) if nodes else 0.0, queued_share=queued[0] / steps,
                outputs=out.new_tokens)


@contextlib.contextmanager
def queued_launches():
    """[steps launched before the step before them was read] (specdec.decode_ahead), counted while inside."""
    from specdec.decode_ahead import DecodeAhead

    launch, count = DecodeAhead.launch, [0]

    def counted(self, seqs, after, rows=None):
        step = launch(self, seqs, after, rows)
        count[0] += after is not None and step is not None
        return step

    DecodeAhead.launch = counted
    try:
        yield count
    finally:
        DecodeAhead.launch = launch


@contextlib.contextmanager
def steps_read_first():
    """Engines built inside read each plain step before launching the next (``Engine(queue_ahead=False)``): the
    same-run baseline of plain decoding queued ahead."""
    from specdec.engine import Engine

    init = Engine.__init__

    def read_first(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "queue_ahead": False})

    Engine.__init__ = read_first
    try:
        yield
    finally:
        Engine.__init__ = init


def plain_merge_launched(loaded, prompts, new_tokens: int, max_tokens: int, capture: bool = True) -> dict:
    """Plain decoding with every split attention's parts merged by the merge kernel, one more launch a layer
    (``MERGE_IN_KERNEL_MAX`` 0), over a graph cache of its own (``max_tokens``: the model's, so the same splits): a
    call that captures, then one timed call. The same-run baseline of merging a small tile's parts in the kernel."""
    from specdec.kernels import tree_attention as ta

    from specdec.cuda_graphs import GraphConfig, GraphedForward

    keep, ta.MERGE_IN_KERNEL_MAX = ta.MERGE_IN_KERNEL_MAX, 0
    graphed = GraphedForward.with_cache(loaded.runner, max_tokens, config=GraphConfig(capture=capture))
    try:
        run_generate(loaded, prompts, new_tokens, cuda_graphs=graphed)
        return run_generate(loaded, prompts, new_tokens, cuda_graphs=graphed)
    finally:
        ta.MERGE_IN_KERNEL_MAX = keep
        graphed.discard()


def prefill_eager_and_chunked(loaded, prompts, max_tokens: int, capture: bool = True, repeats: int = 3) -> dict:
    """A one-token call's prefill (the prompts but their last tokens) in chunks through the buckets
    (GraphedForward.prefill_chunk; a first call captures them) and as one eager forward, the best prefill seconds of
    ``repeats`` calls each, over a graph cache of its own: the same-run baseline of the chunks."""
    from specdec.cuda_graphs import GraphConfig, GraphedForward

    graphed = GraphedForward.with_cache(loaded.runner, max_tokens, config=GraphConfig(capture=capture))
    try:
        run_generate(loaded, prompts, 1, cuda_graphs=graphed)  # its prefill captures the buckets it takes
        chunk, before = graphed.prefill_chunk([len(p) - 1 for p in prompts]), graphed.prefill_replays
        calls = [run_generate(loaded, prompts, 1, cuda_graphs=graphed) for _ in range(repeats)]
        replays = graphed.prefill_replays - before
        graphed.prefill_chunk = lambda rows: None  # this graph cache's prefills: one eager forward
        eager = [run_generate(loaded, prompts, 1, cuda_graphs=graphed) for _ in range(repeats)]
        eager_replays = graphed.prefill_replays - before - replays
    finally:
        graphed.discard()
    return dict(batch=len(prompts), prompt_tokens=max(map(len, prompts)), chunk=chunk, replays=replays / repeats,
                eager_replays=eager_replays,
                chunked_ms=1e3 * min(c["prefill_seconds"] for c in calls),
                eager_ms=1e3 * min(c["prefill_seconds"] for c in eager),
                same_tokens=calls[0]["outputs"] == eager[0]["outputs"])


def hf_static(model, prompt: list[int], new_tokens: int) -> dict:
    """transformers' greedy generate() with its static cache (eager), batch 1: a warm-up, then one timed call."""
    device = next(model.parameters()).device
    x = torch.tensor([prompt], device=device)
    kwargs = dict(attention_mask=torch.ones_like(x), do_sample=False, cache_implementation="static",
                  pad_token_id=0, eos_token_id=None, disable_compile=True)
    with torch.inference_mode():
        model.generate(x, max_new_tokens=2, **kwargs)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        sync(device)
    seconds = time.perf_counter() - t0
    return dict(seconds=seconds, new_tokens=out.shape[1] - x.shape[1],
                tokens_per_s=(out.shape[1] - x.shape[1]) / seconds)


class ModelRun:
    """Every measurement of one model, in order of importance, each only while the model's share lasts."""

    def __init__(self, spec: str, args, device: torch.device, dtype: torch.dtype, bandwidth: float, clock: Clock,
                 save) -> None:
        self.spec, self.args, self.device, self.dtype, self.clock, self.save = spec, args, device, dtype, clock, save
        self.result: dict = dict(model=spec, plain={}, oracle=[], verify_cost=None, replay_launch=None, products=None,
                                 hf_static=None, profile=[], host_python=None, prefill_host_python=None,
                                 prefill_chunks=None, skipped=[], errors=[], item_seconds={})
        self.bandwidth = bandwidth

    def item(self, name: str, fn, estimate: float | None = None) -> None:
        """Run one measurement while the model's share lasts (and, given an estimate of its seconds, if it fits)."""
        if not self.clock.allows() or (estimate is not None and estimate > self.clock.share_left()):
            self.result["skipped"].append(name if estimate is None else f"{name} (~{estimate:.0f} s)")
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as err:  # one failed measurement must not lose the others
            self.result["errors"].append(f"{name}: {type(err).__name__}: {' '.join(str(err).split())[:400]}")
        self.result["item_seconds"][name] = round(time.perf_counter() - t0, 2)  # what the next run's budget needs
        print(f"[speed] {self.spec}: {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
        self.save()

    def run(self) -> dict:
        from specdec.models import synthetic

        args = self.args
        t0 = time.perf_counter()
        self.loaded, note = load(self.spec, args.embedded, self.device, self.dtype)
        self.result["note"] = note
        model = self.loaded.model  # laid out fused (QKV / gate-up) by the loader, on every device
        fused = self.loaded.runner.fused_projections() or []
        self.result["fused_layers"] = sum(p.qkv is not None and p.gate_up is not None for p in fused)
        self.eagle = synthetic.eagle_head(model.config, device=self.device, dtype=self.dtype)
        if args.rehearse:  # its projections too, as eagle_head lays them out on CUDA
            from specdec.models.fused_projections import pack_layers

            pack_layers(self.eagle.layers)
        sync(self.device)
        wbytes = weight_bytes(model)
        floor_ms = 1e3 * wbytes / self.bandwidth
        eagle_bytes = sum(p.numel() * p.element_size() for p in self.eagle.parameters())  # read once per level
        self.result.update(build_seconds=round(time.perf_counter() - t0, 2), weight_bytes=wbytes,
                           floor_step_ms=floor_ms, eagle_draft_vocab=len(self.eagle.config.draft_vocab) or None,
                           eagle_weight_bytes=eagle_bytes)
        self.presize_graphs()
        gen = torch.Generator().manual_seed(0)
        vocab = self.loaded.runner.shape.vocab_size
        pool = torch.randint(vocab, (max(args.batches), args.prompt_len), generator=gen).tolist()
        self.references: dict[int, dict] = {}
        self.draft_seconds_per_step: float | None = None  # the EAGLE layer's at batch 1, from the first batch-1 row
        b0, rest = args.batches[0], args.batches[1:]
        first, others = args.taus[0], args.taus[1:]

        def oracle(b: int, tau: float, shape: str, eagle: bool, speculation: str = "always",
                   depth: int | None = None) -> None:
            name = f"oracle {shape}{'' if depth is None else f' depth {depth}'} tau {tau} b{b}"
            name += (" +eagle" if eagle else "") + ("" if speculation == "always" else f" {speculation}")
            self.item(name, lambda: self.oracle(pool[:b], tau, shape, eagle, speculation, depth),
                      self.estimate(b, tau) if eagle else None)

        # the goals' rows first: plain, the curve, the EAGLE chains at tau 3, the default policy at the largest batch
        self.item(f"plain b{b0}", lambda: self.plain(pool[:b0]))
        if self.graphs is not None:  # split attention merged by a second launch: what merging in the kernel saves
            self.item(f"plain b{b0} merge launched", lambda: self.merge_launched(pool[:b0]))
        self.item("verify cost", lambda: self.curve(pool[0]))
        self.item("replay launch", self.replay_launch)
        self.item("products", self.products)
        oracle(b0, first, "chain", True)
        oracle(b0, first, "chain", True, depth=SHORT_CHAIN_DEPTH)
        for b in reversed(rest):  # the largest batch first: the goals name batch 32
            self.item(f"plain b{b}", lambda b=b: self.plain(pool[:b]))
            for shape in ("chain", "tree"):  # what a user gets there: the policy sizes the trees, the guard may skip
                oracle(b, first, shape, False, "auto")
        oracle(b0, first, "tree", True)
        self.item(f"profile b{b0}", lambda: self.profile(pool[:b0], first))
        self.item(f"profile prefill b{b0}", lambda: self.profile_prefill(pool[:b0]))
        if self.graphs is not None:  # what a prefill in chunks through the buckets saves against one eager forward
            self.item(f"prefill b{b0} in chunks", lambda: self.prefill_chunks(pool[:b0]))
        for b in reversed(rest):
            oracle(b, first, "chain", False)
        if rest:  # where a batch's drafted step spends its time: the batch goal's row, profiled
            self.item(f"profile b{rest[-1]}", lambda: self.profile(pool[:rest[-1]], first, batch_rows=True))
        for tau in others:
            for shape in ("chain", "tree"):
                oracle(b0, tau, shape, True)
        if not args.no_hf:
            self.item("transformers static cache b1", lambda: self.hf(pool[0]))
        for b in reversed(rest):  # EAGLE rows at batch > 1: estimated, so they come after the cheaper rows
            oracle(b, first, "chain", True)
        for b in reversed(rest):
            for tau in args.taus:
                for shape in ("chain", "tree"):
                    if (shape, tau) != ("chain", first):
                        oracle(b, tau, shape, False)
        self.result["seconds"] = round(time.perf_counter() - t0, 1)
        return self.result

    def presize_graphs(self) -> None:
        """The model's graph cache (cuda_graphs="auto") sized once for the largest request of the run, so no timed
        call rebuilds it and recaptures its buckets."""
        from specdec.cuda_graphs import auto_uses_graphs, model_graphs
        from specdec.kv_cache import blocks_needed
        from specdec.tree import MAX_TREE_NODES

        runner = self.loaded.runner
        self.graphs = None
        if auto_uses_graphs(runner):
            lengths = [self.args.prompt_len] * max(self.args.batches)
            self.graphs = model_graphs(runner, 16, blocks_needed(lengths, self.args.new_tokens, 16, MAX_TREE_NODES))

    def plain(self, prompts) -> None:
        """Plain decoding's row; at the first batch also with each step read before the next is launched (the
        engine's steps without specdec/decode_ahead.py): what queuing a step ahead saves, in the same run."""
        b = len(prompts)
        # warm-up, the same call: compiles the kernels and captures every bucket the timed call meets
        run_generate(self.loaded, prompts, self.args.new_tokens)
        row = run_generate(self.loaded, prompts, self.args.new_tokens)
        self.references[b] = {tuple(p): out for p, out in zip(prompts, row.pop("outputs"), strict=True)}
        step_floor = self.result["floor_step_ms"]
        row.update(floor_tokens_per_s=b * 1e3 / step_floor, step_over_floor=row["step_ms"] / step_floor)
        if b == self.args.batches[0]:
            with steps_read_first():
                first = run_generate(self.loaded, prompts, self.args.new_tokens)
            row.update(read_first_tokens_per_s=first["decode_tokens_per_s"],
                       read_first_same_text=first["outputs"] == [self.references[b][tuple(p)] for p in prompts])
        self.result["plain"][str(b)] = row

    def merge_launched(self, prompts) -> None:
        b = len(prompts)
        row = plain_merge_launched(self.loaded, prompts, self.args.new_tokens,
                                   self.graphs.max_keys - self.graphs.cache.block_size)
        self.result["plain"][str(b)].update(
            merge_launched_tokens_per_s=row["decode_tokens_per_s"],
            merge_launched_same_text=row["outputs"] == [self.references[b][tuple(p)] for p in prompts])

    def curve(self, prompt) -> None:
        from specdec.cuda_graphs import auto_uses_graphs
        from specdec.sampling import SamplingConfig
        from specdec.verify_cost import measure_verify_costs

        # the engine's verify timer over n = root + a chain of n - 1, rounds interleaving the sizes, graphed on CUDA
        # rounds of every size must fit the context even if every chain were accepted (smollm2: 8,192 positions)
        room = (self.loaded.runner.shape.max_positions - len(prompt) - 2) // sum(self.args.sizes) - 1
        repeats = max(1, min(3 if self.args.rehearse else 5, room))
        costs = measure_verify_costs(self.loaded.runner, [prompt], self.args.sizes, SamplingConfig(), repeats=repeats,
                                     graphs=auto_uses_graphs(self.loaded.runner))
        base = costs.get(1) or min(costs.values())
        self.result["verify_cost"] = dict(ms={n: 1e3 * c for n, c in costs.items()},
                                          ratio={n: c / base for n, c in costs.items()})

    def replay_launch(self) -> None:
        """Per batch-1 verify graph of the model's cache (generate()'s), of 1 and of the most tokens, the host's
        launch and the replay with its wait (:func:`launch_times`): a drafted step is read back, so the device idles
        while the host launches its verify. Batch-1 buckets not captured yet are captured first (as the rows after
        would); the bucket's inputs are padding for these replays (every row writes the scratch slot: no sequence's
        K/V). None without captured graphs (a CPU)."""
        g, rows = self.graphs, {}
        if g is not None and g.config.capture:
            g.warm_up(1)
            most = g.config.tokens_per_seq[-1]
            for bucket in list(g.buckets.values()):
                if bucket.batch == 1 and bucket.graph is not None and bucket.tokens_per_seq in (1, most) \
                        and not bucket.feature_layers:
                    g.inputs.pad_(bucket.inputs)
                    rows[bucket.tokens_per_seq] = launch_times(bucket.graph.replay, lambda: sync(self.device))
        self.result["replay_launch"] = rows or None

    def products(self) -> None:
        """The products alone over PRODUCT_SIZES rows (benchmarks/products_curve.py), against their weight-read
        floor; on CUDA once more with cuBLASLt as torch's cuBLAS backend (the kernels it picks for few rows differ)."""
        runner = self.loaded.runner
        sizes, repeats = list(PRODUCT_SIZES), 3 if self.args.rehearse else 10
        wbytes = product_bytes(runner)
        row = dict(ms=products_ms(runner, sizes, repeats), weight_bytes=wbytes, floor_ms=1e3 * wbytes / self.bandwidth,
                   cublaslt_ms=None, cublaslt_error=None)
        self.result["products"] = row
        if self.device.type == "cuda":
            try:
                with blas_library("cublaslt"):
                    row["cublaslt_ms"] = products_ms(runner, sizes, repeats)
            except RuntimeError as err:
                row["cublaslt_error"] = " ".join(str(err).split())[:200]

    def estimate(self, batch: int, tau: float) -> float | None:
        """Seconds of an EAGLE row at ``batch`` (warm-up + timed call), from the batch-1 row's drafting time. The
        layer drafts all sequences together, one forward per depth, so a step costs less than ``batch`` lone steps;
        ``max(1, batch / 4)`` of one is a margin, not a measurement."""
        if self.draft_seconds_per_step is None:
            return None
        return 2 * self.args.new_tokens / tau * max(1.0, batch / 4) * self.draft_seconds_per_step

    def oracle(self, prompts, tau: float, shape: str, eagle: bool, speculation: str = "always",
               depth: int | None = None) -> None:
        from specdec.eval.oracle_drafter import AcceptanceProfile, OracleDrafter

        from specdec.cost_model import CALIBRATIONS

        b = len(prompts)
        if b not in self.references:
            self.plain(prompts)
        depth, width = (depth or CHAIN_DEPTH, 1) if shape == "chain" else (depth or TREE_DEPTH, TREE_WIDTH)
        profile = AcceptanceProfile.for_tau(tau, depth, width)
        nodes = depth * width
        inners = []

        def drafter():
            inners.append(self.eagle_drafter(depth, width) if eagle else None)
            return OracleDrafter(self.references[b], profile, inner=inners[-1], seed=1)

        if speculation != "always":
            self.ready_for_the_policy(b)
        # warm-up, the same call
        run_generate(self.loaded, prompts, self.args.new_tokens, drafter=drafter(), speculation=speculation)
        graphs = inners[0].graphs if eagle else None  # kept on the EAGLE model: the timed call replays its graphs
        replays, calibrations = (graphs.replays if graphs is not None else 0), CALIBRATIONS["verify"]
        row = run_generate(self.loaded, prompts, self.args.new_tokens, drafter=drafter(), speculation=speculation)
        row["draft_graph_replays"] = (graphs.replays - replays) if graphs is not None else 0
        row["draft_graphs_captured"] = graphs is not None and graphs.config.capture  # False: uncaptured (CPU)
        row["calibrations_timed"] = CALIBRATIONS["verify"] - calibrations  # 0, or the row timed a calibration too
        outputs = row.pop("outputs")
        plain = self.result["plain"][str(b)]
        same = sum(out == self.references[b][tuple(p)] for p, out in zip(prompts, outputs, strict=True))
        if eagle and b == 1 and self.draft_seconds_per_step is None:
            self.draft_seconds_per_step = row["draft_seconds"] / row["steps"]
        row.update(shape=shape, depth=depth, batch=b, eagle=eagle, speculation=speculation, tau_target=tau,
                   nodes=nodes, profile_rate=profile.rates[0],
                   speedup=row["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                   bound=self.bound(row["tau"], depth if eagle else 0), identical_to_plain=f"{same}/{b}")
        self.result["oracle"].append(row)

    def ready_for_the_policy(self, batch: int) -> None:
        """Before a default-policy row: the policy sizes trees by measured times, so its timed call may meet tree
        sizes and batch sizes its warm-up did not. Every graph bucket of up to ``batch`` sequences is captured now,
        and the cost model's curve of every batch size the call passes through as its sequences finish (1, 2, 4, ...,
        ``batch`` rounded up) is calibrated now: a call calibrates those it lacks when its engine is built, and a
        calibration inside the timed call (a cache, its own graphs, ~40 steps) would be timed with it."""
        from specdec.cost_model import CalibrationConfig, load_cost_model

        runner = self.loaded.runner
        if self.graphs is not None:
            self.graphs.warm_up(batch)
        graphs = self.graphs is not None and self.graphs.config.capture  # as generate() prices its verify steps
        load_cost_model(runner, CalibrationConfig(graphs=graphs), batch=batch)

    def bound(self, tau: float, eagle_levels: int) -> float:
        """The speedup weight reads allow: tau (the row's measured) tokens per step, a step reading the target's
        weights once (a verify at the floor) and the EAGLE layer's once per level drafted, at the copy bandwidth of
        this run."""
        floor = self.result["floor_step_ms"]
        return tau * floor / (floor + eagle_levels * 1e3 * self.result["eagle_weight_bytes"] / self.bandwidth)

    def eagle_drafter(self, depth: int, width: int, graphs: bool = True):
        """The random EAGLE layer drafting a fixed tree, graphs on: captured on CUDA (what "auto" does there);
        uncaptured on the CPU, so the rehearsal runs the padded static growth the GPU replays. ``graphs=False``:
        eager (the profile's count of each op's kernels)."""
        from specdec.drafters.eagle import EagleDrafter

        return EagleDrafter(model=self.eagle, depth=depth, top_k=width, max_nodes=depth * width, adapt_depth=False,
                            cuda_graphs=graphs)

    def profile(self, prompts, tau: float, batch_rows: bool = False) -> None:
        """Plain decoding, the oracle chain at ``tau`` with EAGLE's drafting (replayed, then eager: the kernels each
        op of a level launches) and the oracle's 64-node tree (each step a 65-token verify: c(65)), each one call
        under the profiler (benchmarks/step_profile.py), after the timed rows warmed them up (kernels compiled,
        graphs captured). ``batch_rows``: plain decoding and the oracle chain under ``speculation="auto"`` alone
        (a batch's rows: the policy's host work beside the device's)."""
        from specdec.eval.oracle_drafter import AcceptanceProfile, OracleDrafter

        b = len(prompts)
        if b not in self.references:
            self.plain(prompts)
        tokens = min(self.args.new_tokens, PROFILE_TOKENS)
        chain = AcceptanceProfile.for_tau(tau, CHAIN_DEPTH, 1)
        tree = AcceptanceProfile.for_tau(tau, TREE_DEPTH, TREE_WIDTH)
        calls = [(f"plain b{b}", {})]
        replayed = f"oracle chain tau {tau} +eagle b{b}"  # profiled, then once more under cProfile

        def replayed_chain() -> dict:
            return dict(drafter=OracleDrafter(self.references[b], chain, inner=self.eagle_drafter(CHAIN_DEPTH, 1),
                                              seed=1), speculation="always")

        if batch_rows:
            calls.append((f"oracle chain tau {tau} auto b{b}",
                          dict(drafter=OracleDrafter(self.references[b], chain, seed=1), speculation="auto")))
        else:
            calls += [(replayed, replayed_chain()),
                      (f"oracle chain tau {tau} +eagle eager b{b}",
                       dict(drafter=OracleDrafter(self.references[b], chain,
                                                  inner=self.eagle_drafter(CHAIN_DEPTH, 1, graphs=False), seed=1),
                            speculation="always")),
                      (f"oracle tree tau {tau} b{b}",
                       dict(drafter=OracleDrafter(self.references[b], tree, seed=1), speculation="always"))]
        for name, kwargs in calls:
            t0 = time.perf_counter()
            with profiled(self.device) as trace:
                row = run_generate(self.loaded, prompts, tokens, **kwargs)
            summary = trace.summary()
            self.result["profile"].append(dict(call=name, new_tokens=tokens, tau=row["tau"], summary=summary,
                                               seconds=round(time.perf_counter() - t0, 2)))  # the trace's reading too
        if batch_rows:
            return
        # the chain with EAGLE's replayed drafting once more, its host's Python under cProfile
        t0 = time.perf_counter()
        kwargs = replayed_chain()
        host = host_python(lambda: run_generate(self.loaded, prompts, tokens, **kwargs), lambda row: row["steps"])
        self.result["host_python"] = dict(call=replayed, new_tokens=tokens, **host,
                                          seconds=round(time.perf_counter() - t0, 2))

    def profile_prefill(self, prompts) -> None:
        """A one-token call's prefill (the prompt but its last token, each call's first work, in chunks where
        GraphedForward.prefill_chunk gives some) under the profiler, then the whole call (set-up, prefill, its step)
        under cProfile: what a call costs before its steps, which a short answer pays in full."""
        b = len(prompts)
        t0 = time.perf_counter()
        with profiled(self.device) as trace:
            run_generate(self.loaded, prompts, 1)
        self.result["profile"].append(dict(call=f"prefill b{b}", new_tokens=1, tau=1.0, summary=trace.summary("add"),
                                           seconds=round(time.perf_counter() - t0, 2)))
        t0 = time.perf_counter()
        host = host_python(lambda: run_generate(self.loaded, prompts, 1), lambda row: 1)
        self.result["prefill_host_python"] = dict(call=f"a one-token call b{b} (set-up, prefill, its step)",
                                                  new_tokens=1, **host, seconds=round(time.perf_counter() - t0, 2))

    def prefill_chunks(self, prompts) -> None:
        self.result["prefill_chunks"] = prefill_eager_and_chunked(
            self.loaded, prompts, self.graphs.max_keys - self.graphs.cache.block_size)

    def hf(self, prompt) -> None:
        self.result["hf_static"] = hf_static(self.loaded.model, prompt, self.args.new_tokens)


def _queued(r: dict) -> str:
    """", N% queued": the steps launched before the one before them was read (a held-off stretch's; absent from a
    report written before they were counted)."""
    return f", {100 * r['queued_share']:.0f}% queued" if "queued_share" in r else ""


def _drafting(row: dict) -> str:
    """The oracle row's drafting: none, or EAGLE's, eager, replayed as CUDA graphs (how many growths were) or, on
    the CPU, the padded static growth uncaptured."""
    if not row["eagle"]:
        return "none"
    replays = row.get("draft_graph_replays", 0)
    if not replays:
        return "EAGLE, eager"
    if row.get("draft_graphs_captured", True):  # older reports lack the field: they ran on CUDA
        return f"EAGLE, {replays} graph replays"
    return f"EAGLE, {replays} uncaptured static growths"


def _bound(row: dict) -> str:
    """The row's weight-read bound (reports before 2026-11-29 have none)."""
    return f"{row['bound']:.2f}x" if row.get("bound") is not None else ""


def _prefill_line(row: dict | None) -> list[str]:
    """The prefill in chunks through the buckets against one eager forward (older reports have none)."""
    if not row:
        return []
    how = (f"{row['replays']:.0f} replays of up to {row['chunk']} tokens" if row["chunk"] else
           "no chunking: eager both times")
    other = "" if row["same_tokens"] else " (other first tokens!)"
    return ["", f"prefill of {row['prompt_tokens'] - 1} tokens, batch {row['batch']} (a one-token call's, best of 3): "
                f"eager {row['eager_ms']:.2f} ms, in chunks through the buckets {row['chunked_ms']:.2f} ms ({how})"
                f"{other}"]


def _products_rows(m: dict) -> list[str]:
    """The products-alone table beside c(n) (older reports have none)."""
    row = m.get("products")
    if not row:
        return []
    ms = {int(n): v for n, v in row["ms"].items()}  # int keys live, strings from JSON
    sizes = sorted(ms)
    curve = {int(n): v for n, v in ((m.get("verify_cost") or {}).get("ms") or {}).items()}
    p1, floor = ms[sizes[0]], row["floor_ms"]
    lines = ["", f"products alone (every layer's and the LM head; one CUDA graph per n on a GPU): p(1) = {p1:.3f} ms, "
                 f"{p1 / floor:.2f}x their weight-read floor ({floor:.3f} ms, {row['weight_bytes'] / 1e9:.2f} GB); "
                 "c(n) - p(n) is attention, norms and the rest", "",
             "| n | " + " | ".join(str(n) for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|",
             "| c(n) ms | " + " | ".join(f"{curve[n]:.3f}" if n in curve else "" for n in sizes) + " |",
             "| p(n) ms | " + " | ".join(f"{ms[n]:.3f}" for n in sizes) + " |",
             "| p(n) / p(1) | " + " | ".join(f"{ms[n] / p1:.2f}" for n in sizes) + " |"]
    if row.get("cublaslt_ms"):
        lt = {int(n): v for n, v in row["cublaslt_ms"].items()}
        lines.append("| p(n) ms, cuBLASLt | " + " | ".join(f"{lt[n]:.3f}" for n in sizes) + " |")
    elif row.get("cublaslt_error"):
        lines += ["", f"cuBLASLt: not measured ({row['cublaslt_error']})"]
    return lines


def markdown(report: dict) -> str:
    env = report["env"]
    lines = [f"# specdec speed, {report['date']}", "",
             f"{env['device_name']}, {env['dtype']}, torch {env['torch']}; copy bandwidth "
             f"{env['copy_gb_per_s']:.0f} GB/s; {report['new_tokens']} new tokens per sequence after "
             f"{report['prompt_len']}-token random prompts"
             + ("; REHEARSAL (CPU, tiny shapes)." if report["rehearse"] else "."), ""]
    for m in report["models"]:
        lines += [f"## {m['model']}", ""] + ([f"Measured on {m['note']}.", ""] if m.get("note") else [])
        if "weight_bytes" in m:
            lines.append(f"{m['weight_bytes'] / 1e9:.2f} GB of weights; floor {m['floor_step_ms']:.3f} ms/step; "
                         f"built in {m['build_seconds']} s; EAGLE draft vocabulary {m['eagle_draft_vocab'] or 'full'}; "
                         f"fused QKV / gate-up projections in {m.get('fused_layers', 0)} layers")
        if m["plain"]:
            lines += ["", "| batch | decode tok/s | floor tok/s | step ms | step / floor | prefill ms | steps read "
                          "first: tok/s | split parts merged by a second launch: tok/s |", "|---" * 8 + "|"]
            for b, r in sorted(m["plain"].items(), key=lambda kv: int(kv[0])):
                first, merged = (
                    "" if f"{key}_tokens_per_s" not in r else
                    f"{r[f'{key}_tokens_per_s']:.1f}" + ("" if r[f"{key}_same_text"] else " (other text!)")
                    for key in ("read_first", "merge_launched"))
                lines.append(f"| {b} | {r['decode_tokens_per_s']:.1f} | {r['floor_tokens_per_s']:.1f} | "
                             f"{r['step_ms']:.3f} | {r['step_over_floor']:.2f} | {1e3 * r['prefill_seconds']:.1f} | "
                             f"{first} | {merged} |")
        if m["hf_static"]:
            p1 = m["plain"].get("1")  # the same definition on both sides: new tokens / seconds, prefill included
            ratio = "" if not p1 else (f"; specdec plain, counted alike, is "
                                       f"{p1['new_tokens'] / p1['seconds'] / m['hf_static']['tokens_per_s']:.2f}x it")
            lines += ["", f"transformers static-cache generate(), batch 1: {m['hf_static']['tokens_per_s']:.1f} tok/s "
                          f"(prefill included){ratio}"]
        if m["verify_cost"]:
            # int keys in a live run, strings once the report went through JSON (a re-rendered speed.json)
            ratio = {int(n): c for n, c in m["verify_cost"]["ratio"].items()}
            ms = {int(n): c for n, c in m["verify_cost"]["ms"].items()}
            picks = [n for n in (1, 2, 4, 8, 16, 24, 32, 48, 64, 65) if n in ratio]
            lines += ["", "verify cost c(n) / c(1): " + ", ".join(f"{n}: {ratio[n]:.2f}" for n in picks)
                      + f" (c(1) = {ms[min(ratio)]:.3f} ms)"]
        if m.get("replay_launch"):  # absent from reports written before it was measured
            lines += ["", "a batch-1 verify graph on an idle device, host launch / replay waited for: " + ", ".join(
                f"{n} tokens {r['launch_ms']:.3f} / {r['replay_ms']:.3f} ms"
                for n, r in sorted(m["replay_launch"].items(), key=lambda kv: int(kv[0])))]
        lines += _products_rows(m) + _prefill_line(m.get("prefill_chunks"))  # older reports have none
        if m["oracle"]:
            lines += ["", "| oracle | batch | nodes | drafting | speculation | tau target | tau | step ms | "
                          "draft ms/step | decode tok/s | speedup vs plain | weight-read bound | same text |",
                      "|---" * 13 + "|"]
            for r in m["oracle"]:
                kept = "" if r.get("speculation", "always") == "always" else (
                    f" ({r['verified_nodes']:.1f} verified, {100 * r['drafted_share']:.0f}% of steps drafted"
                    f"{_queued(r)})")
                lines.append(f"| {r['shape']} | {r['batch']} | {r['nodes']}{kept} | {_drafting(r)} | "
                             f"{r.get('speculation', 'always')} | "
                             f"{r['tau_target']:.1f} | {r['tau']:.2f} | {r['step_ms']:.3f} | "
                             f"{1e3 * r['draft_seconds'] / r['steps']:.3f} | {r['decode_tokens_per_s']:.1f} | "
                             f"**{r['speedup']:.2f}x** | {_bound(r)} | {r['identical_to_plain']} |")
        lines += markdown_rows(m) + host_python_lines(m.get("host_python"))  # older reports have none
        lines += host_python_lines(m.get("prefill_host_python"))
        if m["skipped"]:
            lines += ["", "skipped (out of time): " + "; ".join(m["skipped"])]
        if m["errors"]:
            lines += ["", "errors:", ""] + [f"- {e}" for e in m["errors"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rehearse:
        device, dtype = torch.device("cpu"), torch.float32
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        print("bench_speed_gpu.py needs a CUDA GPU, or --rehearse for the CPU rehearsal", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM  # noqa: F401  (imported before the clock starts)

    clock = Clock(args.budget)
    bandwidth = copy_bandwidth(device, args.rehearse)
    report = dict(date=str(datetime.datetime.now().replace(microsecond=0)), rehearse=args.rehearse,
                  new_tokens=args.new_tokens, prompt_len=args.prompt_len, budget_s=args.budget,
                  env=dict(device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                           dtype=str(dtype).replace("torch.", ""), torch=torch.__version__,
                           copy_gb_per_s=bandwidth / 1e9), models=[])

    def save() -> None:
        write_json(out / "speed.json", report, indent=1)  # whole or not at all: a run stopped mid-write keeps the last
        write_text(out / "speed.md", markdown(report))

    for i, spec in enumerate(args.models):
        # the first model (the 8B shape) gets FIRST_MODEL_WEIGHT shares to a later one's 1
        clock.start_share(len(args.models) - i, FIRST_MODEL_WEIGHT if i == 0 else 1.0)
        run = ModelRun(spec, args, device, dtype, bandwidth, clock, save)
        report["models"].append(run.result)
        try:
            run.run()
        except Exception as err:  # a model that cannot be built or loaded: say so, go on with the next
            run.result["errors"].append(f"load: {type(err).__name__}: {' '.join(str(err).split())[:400]}")
        finally:
            run.loaded = run.eagle = None
            gc.collect()  # a model and its graph cache reference each other
            if device.type == "cuda":
                torch.cuda.empty_cache()
        save()
    report["seconds"] = round(args.budget - (clock.end - time.perf_counter()), 1)
    save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    run_main(main)
