"""``specdec eval replay record`` and ``specdec eval replay run`` (parsers registered by specdec/eval/cli.py).

    specdec eval replay record --out run.json --category chat --prompts 5 --max-new-tokens 128
    specdec eval replay run --record run.json --drafter ngram --drafter-option max_nodes=16
    specdec eval replay run --record run.json --drafter ngram --max-nodes 4,8,16 --temperature 0.7 --json
    specdec eval replay bound --record run.json --drafter ngram

``record`` runs plain decoding (greedy unless --temperature > 0) and writes the record; ``run`` replays a
drafter over it offline (specdec.eval.replay) and prints one row per tree budget: predicted tau, mean tree size,
costs and predicted speedup over plain decoding; ``bound`` prints what perfect foresight could reach on a greedy
record (specdec.eval.replay_bounds): the copy bound of every prompt-lookup drafter, the oracle over the drafter's
own trees, and its guarded replay, each as tau, decode speedup and speedup with the prefill included.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from specdec.eval.cli import counted

from specdec.help_format import name_commands, path_arg
from specdec.models.embedded import DEFAULT_ALIAS


def _threads(record: dict) -> str:
    """The recording's CPU threads as a reader says them ("1 thread", "4 threads"; "? threads" where not kept)."""
    threads = record.get("threads")
    return counted(threads, "thread") if isinstance(threads, int) else "? threads"


def add_parser(ev_sub, inference) -> None:
    r = ev_sub.add_parser("replay", help="record a run, then predict any drafter's tau and speed offline",
                          description="Record a plain run (committed tokens, the target's top-k probabilities, "
                                      "measured costs), then replay drafters over it without the target.")
    r_sub = r.add_subparsers(dest="replay_command", required=True)
    rec = r_sub.add_parser("record", help="run plain decoding and write a replay record")
    rec.add_argument("--out", required=True, type=path_arg,
                     help="record file to write (JSON); an existing file needs --overwrite")
    rec.add_argument("--overwrite", action="store_true",
                     help="replace an earlier record at --out (never an input or a file that is no record)")
    rec.add_argument("--model", default=DEFAULT_ALIAS, type=path_arg, help=f"model (default: {DEFAULT_ALIAS})")
    rec.add_argument("--categories", "--category", dest="category", default=None,  # eval acceptance's spelling
                     help="comma list of built-in prompt categories (default: chat; none with --prompts-file "
                          "unless given)")
    rec.add_argument("--prompts", type=int, default=None,
                     help="prompts per category (default 5; a --prompts-file runs whole unless given)")
    rec.add_argument("--prompts-file", type=path_arg,
                     help="your own prompts, each record in its own category (formats: docs/benchmark-files.md); a "
                          "conversation's first turn is recorded, after its system messages")
    rec.add_argument("--prompt-column", default=None, help="the field or column holding the prompt")
    rec.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    rec.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    rec.add_argument("--top-k", type=int, default=20, help="target tokens kept per position (default 20)")
    rec.add_argument("--costs", choices=("cost-model", "measure"), default="cost-model",
                     help="where the verify costs come from: cost-model (default), the engine's cached cost model; "
                          "measure, timed here at the prompts' context")
    rec.add_argument("--cost-repeats", type=int, default=None,
                     help="with --costs measure: timed steps per size (default 3)")
    rec.add_argument("--seed", type=int, default=0,
                     help="seed of the sampling with --temperature > 0 (default 0; greedy samples nothing)")
    rec.set_defaults(func=inference(run_record, sigterm=True))  # SIGTERM from the start: the model load too

    run = r_sub.add_parser("run", help="replay a drafter over a record")
    run.add_argument("--record", required=True, type=path_arg, help="record written by `specdec eval replay record`")
    run.add_argument("--drafter", default="ngram", help="drafter name (default: ngram)")
    run.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                     help="drafter option, repeatable; VALUE parsed as JSON when possible")
    run.add_argument("--max-nodes", default=None,
                     help="cut every tree to N nodes; a comma list replays each (default: trees as proposed)")
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; needs a greedy record)")
    run.add_argument("--guard", choices=("on", "off"), default="on",
                     help="the engine's tree sizing and break-even guard (on = speculation auto, the default)")
    run.add_argument("--verify-costs", type=path_arg, metavar="FILE[:MODEL]",
                     help="price verifies by another machine's c(n): a JSON file (or an inline JSON object) of "
                          "query tokens -> milliseconds, or a GPU speed report (speed.json) and the model whose "
                          "curve to take")
    run.add_argument("--queued-step", type=float, metavar="MS",
                     help="replay as a GPU engine queues the steps the guard holds off: each costs MS milliseconds "
                          "(the speed report's plain step), drafts are priced against it, n-gram looks back")
    run.add_argument("--look-budget", type=float, default=None,
                     help="with --queued-step: share of a step per queued step spent asking the drafter in "
                          "hindsight (default: the engine's; 0: none)")
    run.add_argument("--json", action="store_true", help="print the results as one JSON document")
    run.set_defaults(func=run_replay)

    bound = r_sub.add_parser("bound", help="perfect-foresight bounds on a greedy record (how far a drafter could go)")
    bound.add_argument("--record", required=True, type=path_arg,
                       help="greedy record written by `specdec eval replay record`")
    bound.add_argument("--drafter", default="ngram", help="drafter whose trees the oracle verifies (default: ngram)")
    bound.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                       help="drafter option, repeatable; VALUE parsed as JSON when possible")
    bound.add_argument("--json", action="store_true", help="print the bounds as one JSON document")
    bound.set_defaults(func=run_bound)
    name_commands(r_sub)


def run_record(args) -> int:
    from specdec.eval.cli import check_at_least, select_conversations
    from specdec.eval.conversations import chat_codec, check_prompts_fit, first_turn_ids
    from specdec.eval.replay_record import RecordConfig, check_record_path, record_run, save_record

    from specdec.cli import flagged_sampling
    from specdec.models.loader import load_model

    check_at_least(("--max-new-tokens", args.max_new_tokens, 1), ("--top-k", args.top_k, 1),
                   *([("--cost-repeats", args.cost_repeats, 1)] if args.cost_repeats is not None else []))
    if args.cost_repeats is not None and args.costs != "measure":  # (left out: RecordConfig's default, 3)
        raise ValueError(f"--cost-repeats {args.cost_repeats} times the verify steps of --costs measure; --costs "
                         f"{args.costs} times none here: give --costs measure, or leave --cost-repeats out")
    if args.temperature == 0 and args.seed != 0:  # the record says what ran: a greedy run has no seed
        print(f"note: --seed {args.seed} left out: at --temperature 0 (greedy) no token is sampled", file=sys.stderr)
        args.seed = 0
    repeats = {} if args.cost_repeats is None else {"cost_repeats": args.cost_repeats}
    config = flagged_sampling(RecordConfig, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                              cost_source=args.costs, **repeats)
    inputs = [x for x in (args.prompts_file, args.model) if x]  # the model too, when it names a file
    check_record_path(args.out, args.overwrite, inputs)
    category = args.category if args.category is not None or args.prompts_file else "chat"
    prompts = args.prompts if args.prompts is not None else (None if args.prompts_file else 5)  # a file: all of it
    conversations = select_conversations(category, prompts, args.prompts_file, args.prompt_column)
    later = sum(len(c.turns) > 1 for c in conversations)
    if later:
        print(f"note: {counted(later, 'conversation')} {'has' if later == 1 else 'have'} later turns; a replay "
              "record keeps each one's first turn (`specdec eval acceptance` measures every turn)", file=sys.stderr)
    loaded = load_model(args.model)
    codec = chat_codec(loaded)  # as eval acceptance encodes a first turn: the system messages, then the user's
    prompt_ids = [first_turn_ids(codec, c) for c in conversations]
    check_prompts_fit(loaded, conversations, dict(enumerate(prompt_ids)), 1, args.max_new_tokens)  # not in mid-run
    print(f"[specdec eval replay record] {loaded.name}: {counted(len(conversations), 'prompt')} x "
          f"{counted(args.max_new_tokens, 'token')}",
          file=sys.stderr)
    record = record_run(loaded, prompt_ids, config, [c.category for c in conversations])
    check_record_path(args.out, args.overwrite, inputs)  # again: the file may have appeared meanwhile
    path = save_record(record, args.out)
    tokens = sum(len(s["new_tokens"]) for s in record["sequences"])
    c1 = record["costs"]["verify_seconds"].get(1)
    print(f"recorded {counted(tokens, 'token')} of {counted(len(conversations), 'prompt')}, "
          f"c_verify(1) = {c1 * 1e3:.2f} ms: {path}")
    return 0


def _budgets(spec: str | None) -> list[int | None]:
    from specdec.tree import MAX_TREE_NODES  # here: specdec.tree imports torch, which the command line does not load

    if spec is None:
        return [None]
    try:
        budgets = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        budgets = []
    if not budgets:
        raise ValueError(f"--max-nodes takes an integer or a comma list of integers, got {spec!r}")
    bad = next((n for n in budgets if not 0 <= n <= MAX_TREE_NODES), None)
    if bad is not None:
        raise ValueError(f"--max-nodes {spec}: {bad} is not a tree size in 0..{MAX_TREE_NODES}")
    return list(dict.fromkeys(budgets))  # a size given twice is one replay, not two rows that differ by timing noise


def run_replay(args) -> int:
    from specdec.eval.cli import _options
    from specdec.eval.replay import ReplayConfig, replay
    from specdec.eval.replay_record import load_record, verify_cost_at

    if args.queued_step is not None and not (math.isfinite(args.queued_step) and args.queued_step > 0):
        raise ValueError(f"--queued-step takes the plain step's milliseconds (> 0), got {args.queued_step}")
    if args.look_budget is not None and args.queued_step is None:
        raise ValueError("--look-budget is spent on queued steps only: give it with --queued-step")
    if args.look_budget is not None and not (math.isfinite(args.look_budget) and args.look_budget >= 0):
        raise ValueError(f"--look-budget takes a share of a step (>= 0; 0: no looks), got {args.look_budget}")
    if args.queued_step is not None and (args.temperature != 0 or args.guard == "off"):
        raise ValueError("--queued-step replays greedily with the guard on (the steps it holds off are the ones "
                         "queued): drop --temperature or --guard off")
    options = _options(args.drafter_option, args.drafter)
    record = load_record(args.record)
    curve = None if args.verify_costs is None else _verify_costs(args.verify_costs)
    queued = None if args.queued_step is None else args.queued_step / 1e3
    results = [replay(record, ReplayConfig(args.drafter, options, n, args.temperature, args.guard == "on", queued,
                                           curve, args.look_budget))
               for n in _budgets(args.max_nodes)]
    if args.json:
        print(json.dumps({"record": str(Path(args.record)), "model": record["model"], "results": results}, indent=1))
        return 0
    tokens = sum(len(s["new_tokens"]) for s in record["sequences"])
    c1 = verify_cost_at(curve or record["costs"]["verify_seconds"], 1)
    where = (f"from {args.verify_costs}" if curve else
             f"{record.get('device', '?')}, {_threads(record)}")
    queued = "" if args.queued_step is None else f", held-off steps queued at {args.queued_step:.3f} ms"
    print(f"{record['model']}, {counted(len(record['sequences']), 'prompt')}, {counted(tokens, 'token')}; "
          f"c_verify(1) = {c1 * 1e3:.2f} ms ({where}){queued}")
    if options:  # as typed: a combined drafter's children's options too, and a max_nodes the cut column is not
        print("drafter options: " + " ".join(f"{k}={json.dumps(v)}" for k, v in options.items()))
    print(f"{'drafter':>12} {'cut':>9} {'guard':>5} {'T':>4} {'tau':>6} {'nodes':>6} {'draft ms':>8} "
          f"{'speedup':>8} {'overall':>8}")
    for r in results:
        budget = "-" if r["max_nodes"] is None else str(r["max_nodes"])
        speed = "-" if r["predicted_speedup"] is None else f"x{r['predicted_speedup']:.2f}"
        overall = "-" if r["predicted_speedup_overall"] is None else f"x{r['predicted_speedup_overall']:.2f}"
        guard = "on" if r["guard"] else "off"
        print(f"{r['drafter']:>12} {budget:>9} {guard:>5} {r['temperature']:>4g} {r['tau']:>6.2f} "
              f"{r['mean_tree_nodes']:>6.1f} {r['cost_draft_s'] * 1e3:>8.3f} {speed:>8} {overall:>8}")
    print("note: cut is --max-nodes, the first N nodes of each tree the drafter proposed (its own options cap it "
          "first)")
    print("note: speedup is the decode phase's; overall counts the prompts' prefill as recorded")
    for note in results[0]["notes"]:
        print(f"note: {note}")
    return 0


def _verify_costs(spec: str) -> dict[int, float]:
    """``--verify-costs``: c(n) in seconds from a JSON object of n -> milliseconds (or one holding it under "ms"),
    in a file or given inline, or ``FILE:MODEL``, a GPU speed report (``speed.json``) and the model whose
    ``verify_cost`` to take."""
    from specdec.errors import InputError

    path, model = spec, None
    inline = spec.lstrip().startswith("{")
    if not inline and not Path(spec).is_file() and ":" in spec:
        path, _, model = spec.rpartition(":")

    def unreadable(err: Exception) -> InputError:
        return InputError(f"--verify-costs {spec}: not a JSON object of query tokens -> milliseconds "
                          f"({str(err).splitlines()[0] if str(err) else type(err).__name__})")

    try:
        data = json.loads(spec if inline else Path(path).read_text())
        models = {str(m.get("model")): m for m in data.get("models", [])} if model is not None else {}
    except (OSError, ValueError, TypeError, AttributeError) as err:
        raise unreadable(err) from None
    if model is not None:
        if "models" not in data:  # a curve or another JSON file, named with a model as if a speed report
            raise InputError(f"--verify-costs {spec}: {path} is no GPU speed report (it has no \"models\"); give a "
                             "curve file without :MODEL")
        if model not in models:
            raise InputError(f"--verify-costs {spec}: no model {model!r} in {path} (it has: "
                             f"{', '.join(models) or 'none'})")
        data = models[model].get("verify_cost") or {}
    try:
        data = data.get("ms", data)
        curve = {int(n): float(ms) / 1e3 for n, ms in data.items()}
    except (ValueError, TypeError, AttributeError) as err:
        raise unreadable(err) from None
    if 1 not in curve:
        raise InputError(f"--verify-costs {spec}: it needs c(1), the verify of one token")
    if min(curve) < 1:
        raise InputError(f"--verify-costs {spec}: c({min(curve)}): a verify queries 1 token or more")
    bad = next((n for n, s in curve.items() if not (math.isfinite(s) and s > 0)), None)
    if bad is not None:
        raise InputError(f"--verify-costs {spec}: c({bad}) = {curve[bad] * 1e3:g} ms is not a positive number of "
                         "milliseconds")
    return curve


def run_bound(args) -> int:
    from specdec.eval.cli import _options
    from specdec.eval.replay import ReplayConfig
    from specdec.eval.replay_bounds import replay_bounds
    from specdec.eval.replay_record import load_record

    record = load_record(args.record)
    out = replay_bounds(record, ReplayConfig(args.drafter, _options(args.drafter_option, args.drafter)))
    if args.json:
        print(json.dumps({"record": str(Path(args.record)), "model": record["model"], **out}, indent=1))
        return 0
    share = "not in this record" if out["prefill_share"] is None else f"{out['prefill_share']:.1%} of plain's time"
    print(f"{record['model']}, {counted(out['sequences'], 'prompt')}, {counted(out['new_tokens'], 'token')} "
          f"({record.get('device', '?')}, "
          f"{_threads(record)}); prefill {share}")
    print(f"{'':>34} {'tau':>6} {'decode':>7} {'overall':>7}")
    rows = (("copy bound (any lookup drafter)", out["copy"]), (f"oracle over {out['drafter']}'s trees", out["oracle"]),
            (f"{out['drafter']} replayed, guard on", out["replay"]))
    for name, r in rows:
        overall = "-" if r["overall_speedup"] is None else f"x{r['overall_speedup']:.2f}"
        decode = "-" if r["decode_speedup"] is None else f"x{r['decode_speedup']:.2f}"
        print(f"{name:>34} {r['tau']:>6.2f} {decode:>7} {overall:>7}")
    print("note: the bounds verify, each step, only the path that will be accepted (perfect foresight); speedups are "
          "over plain decoding on the record's cost curve, overall with the recorded prefill. The copy bound bounds "
          "the speedups; its tau is that of its cheapest steps, and a lookup drafter with longer, dearer steps can "
          "accept more per step")
    return 0
