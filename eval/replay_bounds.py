"""Perfect-foresight bounds over a greedy replay record (``specdec eval replay bound``): the most speculation could
give on the record's text, at the costs of the machine that made the record.

    bounds = replay_bounds(record, ReplayConfig("ngram"))
    bounds["copy"]["overall_speedup"], bounds["oracle"]["decode_speedup"], bounds["replay"]["tau"]

A greedy text is the target's own argmax chain, so what any draft would have accepted is known in advance. Each
bound walks the recorded text and, every step, verifies only the path that will be accepted, priced at
``c_verify(1 + accepted)`` on the record's curve:

- ``copy``: no drafter and no draft time. A step may accept any prefix of the longest continuation of an earlier
  occurrence of the last committed token (at most MAX_TREE_NODES tokens; past the end of the text the continuation
  copies itself, as ``ngram`` drafts it), and the steps are chosen to spend the least verify time over the whole
  text. Every path of a prompt-lookup drafter (``ngram``: the tokens that followed an earlier occurrence of the last
  n >= 1 tokens) is such a continuation, so no lookup drafter, with any options, tree sizing or guard, spends less
  time verifying this text (a step is priced at the cheapest verify of its accepted path or of any larger tree: a
  curve measured cheaper at a larger size gives no drafter a way under the bound).
- ``oracle``: the drafter's own proposals, whole (the budget cut only, no guard), with its draft time: what a
  perfect tree sizer could make of them. It and ``replay`` price a draft alike, at the mean of the drafter's calls
  in both walks. Only drafters that ``specdec.eval.replay`` can replay (token-only).
- ``replay``: the drafter as the engine runs it (``specdec.eval.replay`` with the guard), for comparison.

``decode_speedup`` is over plain decoding priced on the same curve. ``overall_speedup`` adds each prompt's prefill
as measured when the record was made (plain decoding's steps rescaled to the record's measured decode step): a
speedup that includes prefill cannot exceed ``(prefill + plain decode) / prefill``. Records written before prefill
times were kept have ``overall_speedup`` None.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from specdec.eval.replay import (
    ReplayConfig,
    ReplayDrafter,
    overall_speedup,
    plain_step_seconds,
    recorded_prefill,
    replay,
    replay_sequence,
)
from specdec.eval.replay_record import verify_cost_at

from specdec.errors import InputError
from specdec.tree import MAX_TREE_NODES


def copy_accepted(context: list[int], upcoming: list[int], starts: dict[int, list[int]], cap: int) -> int:
    """Longest common prefix (<= cap) of ``upcoming`` and the text after any earlier occurrence of ``context[-1]``,
    read on past the end of ``context`` by copying itself (what ``ngram`` drafts there: "abcab" continues "cabca");
    ``starts[t]`` lists the positions p with ``context[p - 1] == t`` (p < len(context))."""
    best = 0
    limit = min(cap, len(upcoming))
    end = len(context)
    for p in starts.get(context[-1], ()):
        # past the end the copy repeats what it drafted, which equals ``upcoming`` for as long as it matched
        n = 0
        while n < limit and (context[p + n] if p + n < end else upcoming[p + n - end]) == upcoming[n]:
            n += 1
        if n > best:
            best = n
            if best == limit:
                break
    return best


def _copy_walk(prompt: list[int], new: list[int], budget: int, costs: dict[int, float]) -> tuple[int, float]:
    """(steps, verify seconds) of the copy bound over one sequence: the cheapest way through the text when a step
    at position j may accept any k <= reach[j] tokens (a lookup drafter can only accept a copy, and the longest copy
    at j is reach[j]; the text before j is the same whatever the steps were), by dynamic programming from the end.
    A step accepting k is priced at the lowest cost of any verify of ``1 + k`` tokens or more (the curve's monotone
    envelope): on a measured curve that is cheaper at 4 tokens than at 3, a drafter's step verifying 3 nodes to
    accept 2 costs c(4), below c(3)."""
    m = len(new)
    context = list(prompt)
    starts: dict[int, list[int]] = defaultdict(list)
    for p in range(1, len(context)):
        starts[context[p - 1]].append(p)
    reach = []
    for j in range(m):
        cap = max(min(MAX_TREE_NODES, budget - j - 1, m - j - 1), 0)  # the last token comes as the bonus
        reach.append(copy_accepted(context, new[j:], starts, cap))
        starts[context[-1]].append(len(context))  # the committed token joins the context and the index
        context.append(new[j])
    curve = [verify_cost_at(costs, n) for n in range(1, MAX_TREE_NODES + 2)]  # curve[k]: c(1 + k)
    # price[k]: the cheapest verify of 1 + k tokens or more, up to the largest measured size (past it the curve is
    # extrapolated, and a falling last slope would price ever larger trees ever lower)
    largest = max(costs)
    price = [min(curve[k : max(k + 1, largest)]) for k in range(len(curve))]
    seconds, steps = [0.0] * (m + 1), [0] * (m + 1)  # from position j to the end
    for j in range(m - 1, -1, -1):
        seconds[j], steps[j] = min((price[k] + seconds[j + k + 1], 1 + steps[j + k + 1])
                                   for k in range(reach[j] + 1))
    return steps[0], seconds[0]


def _speeds(record: dict, tokens: int, steps: float, seconds: float) -> dict:
    """tau and the decode / overall speedups of a walk that verified for ``seconds`` (record curve seconds)."""
    c1 = verify_cost_at(record["costs"]["verify_seconds"], 1)
    return {"steps": steps, "tau": tokens / steps if steps else 0.0, "seconds": seconds,
            "decode_speedup": tokens * c1 / seconds if seconds else None,
            "overall_speedup": overall_speedup(record, tokens, seconds)}


def replay_bounds(record: dict, config: ReplayConfig) -> dict:
    """The copy bound, the oracle over ``config``'s drafter and its guarded replay (module docstring); JSON-able."""
    if record.get("temperature", 0) != 0:
        raise InputError(f"replay bounds need a greedy record (the text must be the target's argmax chain); this one "
                         f"was sampled at temperature {record['temperature']}")
    if config.temperature != 0:
        raise InputError("replay bounds are greedy: leave the temperature at 0")
    costs = record["costs"]["verify_seconds"]
    budget = int(record["max_new_tokens"])
    sequences = record["sequences"]
    tokens = sum(len(s["new_tokens"]) for s in sequences)
    copy_steps = copy_seconds = 0.0
    for s in sequences:
        st, sec = _copy_walk(list(s["prompt_ids"]), list(s["new_tokens"]), budget, costs)
        copy_steps, copy_seconds = copy_steps + st, copy_seconds + sec
    whole_trees = replace(config, guard=False, max_nodes=None)
    drafter = ReplayDrafter(whole_trees, record)
    oracle_steps = oracle_seconds = 0.0
    for i, s in enumerate(sequences):
        walk = replay_sequence(drafter, i, s, record, whole_trees, costs, oracle=True)
        oracle_steps, oracle_seconds = oracle_steps + walk["steps"], oracle_seconds + walk["verify_seconds"]
    oracle_calls = drafter.calls
    guarded = replay(record, config, drafter)  # one drafter: a stall in either walk prices both rows' drafts alike
    c_draft = guarded["cost_draft_s"]  # the mean of its calls in both walks
    oracle_seconds += c_draft * oracle_calls
    prefill = recorded_prefill(record)
    share = None if prefill is None else prefill / (prefill + tokens * plain_step_seconds(record))
    return {"drafter": drafter.name, "drafter_options": dict(config.drafter_options), "sequences": len(sequences),
            "new_tokens": tokens, "prefill_share": share,
            "copy": _speeds(record, tokens, copy_steps, copy_seconds),
            "oracle": {**_speeds(record, tokens, oracle_steps, oracle_seconds), "cost_draft_s": c_draft},
            "replay": {**_speeds(record, tokens, guarded["steps"], guarded["seconds"]),
                       "cost_draft_s": guarded["cost_draft_s"], "guard": config.guard}}
