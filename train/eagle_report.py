"""The end of a ``train-eagle`` run: held-out accuracies, the tree chosen by speed, checkpoint and report.

    report = finish_eagle(cfg, loaded, eagle, history, held_out, train_seqs, vocab_info, times, accelerator)

Writes ``config.json`` + ``model.safetensors`` (drafters/eagle_checkpoint.py) with the chosen tree (timed; with
``eval_tau`` off, from the accuracies), ``report.json`` and ``report.md`` into the output directory.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from pathlib import Path

from specdec.drafters.eagle_checkpoint import save_eagle
from specdec.train.accuracy_table import ALL_POSITIONS_NOTE, accuracy_cells, accuracy_scopes
from specdec.train.eagle_evaluate import (
    MIN_CHAIN_ACCEPTANCE,
    PAYS_MARGIN,
    choose_tree_by_speed,
    scoped_eagle_accuracies,
    tree_from_accuracies,
    tree_pays,
)
from specdec.train.loop import number
from specdec.train.pipeline import measured, trained_steps, warnings_naming, write_report
from specdec.train.run_seconds import run_seconds, wall_time_line

logger = logging.getLogger(__name__)


def finish_eagle(cfg, loaded, eagle, history, held_out, train_seqs, vocab_info: dict, times: dict,
                 accelerator, prompt_lengths: dict | None = None) -> dict:
    out = Path(cfg.output_dir)
    data = held_out or train_seqs
    # self-distilled: the responses alone too (a chat template is easy to predict and inflates acc)
    scopes = accuracy_scopes(data, prompt_lengths)
    acc, *responses = scoped_eagle_accuracies(loaded.model, eagle, data, cfg.eagle_steps, scopes,
                                              device=accelerator.device)
    acc = {**acc, "top1": measured(acc["top1"], acc["positions"]), "top5": measured(acc["top5"], acc["positions"])}
    if responses:
        acc_r = responses[0]
        acc = {**acc, "response_top1": measured(acc_r["top1"], acc_r["positions"]),
               "response_top5": measured(acc_r["top5"], acc_r["positions"])}
    tree_table: list[dict] = []
    if cfg.eval_tau:
        from specdec.train.distill import encode_prompt
        from specdec.train.evaluate import eval_prompts

        prompts = [encode_prompt(loaded.tokenizer, p) for p in eval_prompts(cfg.eval_prompts)]
        save_eagle(eagle, out)  # the measurement below loads nothing, but a kill here keeps the weights
        with warnings_naming("--eval-max-new-tokens"):
            (depth, top_k, nodes), tree_table = choose_tree_by_speed(loaded, eagle, prompts, cfg.eval_max_new_tokens,
                                                                     progress=cfg.progress)
        choice = {"by": "speed", "pays": any(tree_pays(m) for m in tree_table)}
    else:  # nothing timed: the depth the accuracies support, at most the trained one
        which = "response_top1" if (acc.get("response_top1") or [None])[0] is not None else "top1"
        # the depths measured: a depth no position reached supports no deeper tree
        rates = list(itertools.takewhile(lambda a: a is not None, acc[which]))
        (depth, top_k, nodes), chain = tree_from_accuracies(rates, cfg.eagle_steps)
        choice = {"by": "accuracies", "accuracies": which, "chain_acceptance": chain,
                  "min_chain_acceptance": MIN_CHAIN_ACCEPTANCE}
        logger.info("eagle tree from the %s accuracies, not timed (eval_tau off): depth %d top-k %d nodes %d "
                    "(estimated chain acceptance %s)", which, depth, top_k, nodes, [round(c, 3) for c in chain])
    eagle.config = dataclasses.replace(eagle.config, depth=depth, top_k=top_k, max_nodes=nodes)
    save_eagle(eagle, out, extra={"draft_vocab_coverage": vocab_info.get("coverage")})
    t_end = time.perf_counter()
    report = {
        "config": cfg.to_json(), "model": loaded.name, "drafter": "eagle", "train_sequences": len(train_seqs),
        "held_out_sequences": len(held_out), "accuracy_data": "held-out" if held_out else "training",
        "steps": trained_steps(out, history), "final_loss": history[-1]["loss"] if history else None,
        "top1": acc["top1"], "top5": acc["top5"], "positions": acc["positions"], "draft_vocab": vocab_info,
        "response_top1": acc.get("response_top1"), "response_top5": acc.get("response_top5"),
        "tree": {"depth": eagle.config.depth, "top_k": eagle.config.top_k, "max_nodes": eagle.config.max_nodes},
        "tree_choice": choice, "tree_measurements": tree_table,
        "seconds": run_seconds(times, t_end),
        "processes": accelerator.num_processes,
    }
    write_report(out, report, render_markdown(report))
    logger.info("done: top-1 per depth %s, tree %s", [a if a is None else round(a, 3) for a in acc["top1"]],
                report["tree"])
    return report


def render_markdown(r: dict) -> str:
    c, v = r["config"], r["draft_vocab"]
    vocab = "the full vocabulary" if not v.get("size") else \
        f"a reduced vocabulary of {v['size']} tokens ({100 * v['coverage']:.1f}% of the training tokens)"
    lines = [f"# EAGLE training report: {r['model']}", "",
             f"One draft layer over {vocab}, trained {c['eagle_steps']} draft steps deep; {r['steps']} steps on "
             f"{r['train_sequences']} sequences ({r['processes']} process(es)); final loss "
             f"{number(r['final_loss'], 4)}", "",
             f"Accuracies on {r['held_out_sequences']} held-out sequences:" if r["held_out_sequences"]
             else "Accuracies on the TRAINING data (--held-out-fraction 0): optimistic.", "",
             "| draft depth | top-1 | top-5 | top-1, responses only | top-5, responses only |", "|---|---|---|---|---|"]
    lines += [f"| {d + 1} | {cells} |" for d, cells in enumerate(accuracy_cells(r))]
    lines += ["", ALL_POSITIONS_NOTE]
    if r["tree_measurements"]:
        lines += ["", "Tree chosen by speed (greedy, batch 1, held-out chat prompts; plain decoding timed right before "
                  "each candidate on each prompt, speedup = geometric mean of the per-prompt ratios):", "",
                  "| depth | top-k | nodes | tau | tokens/s | vs plain |",
                  "|---|---|---|---|---|---|"]
        for m in r["tree_measurements"]:
            lines.append(f"| {m['depth']} | {m['top_k']} | {m['max_nodes']} | {m['tau']:.2f} | "
                         f"{m['tokens_per_s']:.1f} | {m['speedup_vs_plain']:.2f}x |")
    t, choice = r["tree"], r.get("tree_choice") or {}
    saved = f"Saved tree: depth {t['depth']}, top-k {t['top_k']}, {t['max_nodes']} nodes"
    if r["tree_measurements"]:
        lines += ["", saved + "."]
        if not any(tree_pays(m) for m in r["tree_measurements"]):
            top = max(r["tree_measurements"], key=lambda m: m["speedup_vs_plain"])
            lines += ["", f"**No tree beat plain decoding on this machine** (the best: {top['speedup_vs_plain']:.2f}x "
                      f"at tau {top['tau']:.2f}; a tree pays only with tau above 1 and at least {PAYS_MARGIN:.2f}x, "
                      "past timing noise). The saved tree is the smallest; at run time the break-even guard decodes "
                      "plainly wherever drafting is not expected to pay, so this layer stays near plain decoding "
                      "here. More varied training data raises its acceptance; a machine where verifying a tree "
                      "costs less (a GPU) changes the balance."]
    elif choice.get("by") == "accuracies":
        which = "responses-only top-1" if choice["accuracies"] == "response_top1" else "top-1"
        chain = ", ".join(f"{c:.2f}" for c in choice["chain_acceptance"])
        lines += ["", f"{saved}, chosen from the {which} accuracies above, **not timed** (--no-eval-tau): the "
                  f"deepest depth up to the trained {c['eagle_steps']} whose estimated chance of accepting the whole "
                  f"chain (the product of the per-depth top-1: {chain}) is at least "
                  f"{choice['min_chain_acceptance']:.2f}, with the largest candidate tree of that depth. Whether it "
                  "pays on a machine was not measured."]
    else:
        lines += ["", saved + " (not measured)."]
    lines += ["", wall_time_line(r["seconds"]), ""]
    return "\n".join(lines)
