"""Medusa drafter on tiny random models: the published checkpoint layout (written independently),
static / dynamic / default trees, greedy identity, sampled law, the CLI, bad input."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import save_file
from specdec.drafters.medusa import MedusaDrafter, validate_choices
from specdec.drafters.medusa_heads import MedusaCheckpointError, MedusaConfig, MedusaHeads, load_medusa, save_medusa
from specdec.drafters.medusa_tree import default_choices, dynamic_tree
from specdec.eval.negative_controls import generate_with_control

import specdec
from specdec.errors import InputError
from specdec.rejection import EXACT
from specdec.testing import build_tiny_model

# batched, ragged lengths, a one-token prompt (no hidden state before its first root)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 8], [10, 20, 30, 10, 20, 30, 10, 20], [5], [11] * 3 + [12, 13]]
STATIC = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def write_published_checkpoint(path, num_heads, num_layers, hidden, vocab, seed=0, lm_head=None, config_extra=None):
    """An independent writer of the FasterDecoding/Medusa layout: plain tensors, safetensors, json."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            state[f"{h}.{layer}.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.2
            state[f"{h}.{layer}.linear.bias"] = torch.randn(hidden, generator=g) * 0.1
        w = lm_head.clone() if lm_head is not None else torch.randn(vocab, hidden, generator=g)
        state[f"{h}.{num_layers}.weight"] = w + 0.05 * torch.randn(vocab, hidden, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "medusa_lm_head.safetensors"))
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": "tiny"}
    config.update(config_extra or {})
    (path / "config.json").write_text(json.dumps(config))
    return state


def reference_head_logp(state, hidden, num_heads, num_layers):
    """[num_heads, vocab] log-probs straight from the tensors: x + silu(Wx + b), then the LM head."""
    out = []
    w = {k: v.double() for k, v in state.items()}
    for h in range(num_heads):
        x = hidden.double()
        for layer in range(num_layers):
            x = x + torch.nn.functional.silu(x @ w[f"{h}.{layer}.linear.weight"].T + w[f"{h}.{layer}.linear.bias"])
        out.append(x @ w[f"{h}.{num_layers}.weight"].T)
    return torch.stack(out).log_softmax(-1)


def no_cost_measurement(*args, **kwargs):
    raise AssertionError("the verify costs were measured before the drafter was refused")


def token_paths(tree):
    """Every node as the tuple of tokens from the root's child down to it."""
    out = []
    for i in range(tree.num_nodes):
        path, j = [], i
        while j >= 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        out.append(tuple(path[::-1]))
    return out


class Recorder(MedusaDrafter):
    def propose(self, seqs):
        trees = super().propose(seqs)
        self.seen = getattr(self, "seen", []) + [(v.last_hidden, t) for v, t in zip(seqs, trees, strict=True)]
        return trees


def lm_head_heads(model, num_heads=3, num_layers=1):
    """Untrained heads whose LM heads copy the target's (Medusa's initialisation): the heads then guess the
    root again at depth 1, which is right often enough on tiny random models to exercise accepted paths."""
    heads = MedusaHeads(MedusaConfig(num_heads, num_layers, model.config.hidden_size, model.config.vocab_size))
    heads.init_lm_heads_from(model.get_output_embeddings().weight.detach())
    return heads


def random_heads(model, num_heads=3, seed=0):
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(num_heads, 1, model.config.hidden_size, model.config.vocab_size))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return heads


@pytest.mark.parametrize("extra", [{}, dict(draft_vocab=(5, 1, 40, 7)), dict(shared_lm_head=True)],
                         ids=["full", "draft-vocab", "shared"])
def test_fresh_heads_from_the_lm_head_are_medusas_start_without_random_draws(extra):
    """from_lm_head (what train-medusa starts from): the same weights and draft ids as building the heads and then
    copying the LM head, on the LM head's device, in float32, with no random draw taken (the generator's state is
    unchanged: nothing drawn only to be overwritten)."""
    from specdec.testing import build_tiny_model

    model = build_tiny_model()
    lm_w = model.get_output_embeddings().weight.detach()
    config = MedusaConfig(2, 2, model.config.hidden_size, model.config.vocab_size, **extra)
    want = MedusaHeads(config)
    want.init_lm_heads_from(lm_w)
    state = torch.get_rng_state()
    got = MedusaHeads.from_lm_head(config, lm_w)
    assert torch.equal(torch.get_rng_state(), state)
    assert got.state_dict().keys() == want.state_dict().keys()
    assert all(torch.equal(a, want.state_dict()[k]) for k, a in got.state_dict().items())
    assert torch.equal(got.draft_ids, want.draft_ids) and got.draft_ids.device == lm_w.device
    assert all(p.device == lm_w.device and p.dtype == torch.float32 for p in got.parameters())


# ---- the published layout, drafted as computed independently ------------------------------------
def test_independently_written_checkpoint_drafts_its_static_top_k(tmp_path):
    model = build_tiny_model()
    state = write_published_checkpoint(tmp_path / "heads", 3, 2, 64, 96, lm_head=model.lm_head.weight.detach())
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    drafter = Recorder(path=str(tmp_path / "heads"), medusa_choices=choices)
    # "always": every step drafts (under the guard, how many steps ask random heads depends on wall times)
    specdec.generate(model, PROMPTS, max_new_tokens=12, drafter=drafter, speculation="always")
    checked = 0
    for hidden, tree in drafter.seen:
        if hidden is None:
            assert tree.num_nodes == 0  # the one-token prompt's first step: nothing to draft from
            continue
        top = reference_head_logp(state, hidden, 3, 2).topk(3, dim=-1).indices  # [heads, 3]
        expected = [int(top[len(p) - 1, p[-1]]) for p in validate_choices(choices, 3)]
        assert tree.tokens.tolist() == expected
        assert tree.parents.tolist() == [-1, -1, -1, 0, 0, 1, 3]
        assert tree.draft_probs is None and tree.mode.value == "deterministic"
        checked += 1
    assert checked >= 20


def test_independently_written_checkpoint_drafts_the_most_probable_paths_dynamically(tmp_path):
    model = build_tiny_model()
    state = write_published_checkpoint(tmp_path / "heads", 3, 1, 64, 96, seed=4)
    top_k, max_nodes = 3, 9
    drafter = Recorder(path=str(tmp_path / "heads"), tree="dynamic", top_k=top_k, max_nodes=max_nodes)
    specdec.generate(model, PROMPTS[:3], max_new_tokens=10, drafter=drafter)
    for hidden, tree in drafter.seen:
        logp = reference_head_logp(state, hidden, 3, 1)  # [3, vocab]
        top = logp.topk(top_k, dim=-1)
        scored = []  # every path of top-k ranks up to depth 3, with its joint log-probability
        for depth in range(1, 4):
            for ranks in itertools.product(range(top_k), repeat=depth):
                toks = tuple(int(top.indices[d, r]) for d, r in enumerate(ranks))
                scored.append((sum(float(top.values[d, r]) for d, r in enumerate(ranks)), toks))
        best = {toks for _, toks in sorted(scored, reverse=True)[:max_nodes]}
        assert tree.num_nodes == max_nodes and set(token_paths(tree)) == best


def test_checkpoint_saved_choices_are_the_default_static_tree(tmp_path):
    model = build_tiny_model()
    write_published_checkpoint(tmp_path / "h", 2, 1, 64, 96, config_extra={"medusa_choices": [[0], [1], [0, 0]]})
    drafter = Recorder(path=str(tmp_path / "h"))
    specdec.generate(model, PROMPTS[:1], max_new_tokens=4, drafter=drafter)
    assert drafter.paths == ((0,), (1,), (0, 0)) and drafter.seen[0][1].parents.tolist() == [-1, -1, 0]


@pytest.mark.parametrize("num_heads, max_nodes", [(1, 1), (3, 8), (4, 16), (5, 64)])
def test_default_choices_fill_the_node_budget_and_are_prefix_closed(num_heads, max_nodes):
    paths = default_choices(num_heads, max_nodes, top_k=8)
    assert len(paths) == max_nodes and validate_choices(paths, num_heads) == paths
    assert max(len(p) for p in paths) == min(num_heads, max_nodes)  # the best path (all rank 0) goes deep first


# ---- greedy identity ------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["llama-gqa-tied", "llama-mha-untied", "qwen3-qknorm"])
@pytest.mark.parametrize("options", [dict(medusa_choices=STATIC), dict(), dict(tree="dynamic", max_nodes=16)],
                         ids=["static", "default-static", "dynamic"])
def test_greedy_identity_with_random_and_lm_head_initialised_heads(variant, options, device):
    model = build_tiny_model(variant).to(device)
    plain = specdec.generate(model, PROMPTS, max_new_tokens=256)
    for heads in (random_heads(model), lm_head_heads(model)):
        # speculation="always": the guard would stop asking heads that do not pay on a tiny model
        out = specdec.generate(model, PROMPTS, max_new_tokens=256, drafter=MedusaDrafter(heads=heads, **options),
                               return_dict=True, speculation="always")
        assert out.sequences == plain
    assert out.tau > 1.2  # the LM-head-initialised heads get drafts accepted: the accepted path is exercised
    for p, ref in zip(PROMPTS[:3], plain[:3], strict=True):  # one at a time, including the one-token prompt
        got = specdec.generate(model, [p], max_new_tokens=256, drafter=MedusaDrafter(heads=lm_head_heads(model),
                                                                                     **options), speculation="always")
        assert got[0] == ref


def test_shared_lm_head_checkpoint_uses_the_target_lm_head():
    model = build_tiny_model("llama-mha-untied")
    heads = MedusaHeads(MedusaConfig(2, 1, 64, 96, shared_lm_head=True))  # zero blocks: heads == the target's head
    drafter = Recorder(heads=heads, tree="dynamic", max_nodes=4)
    plain = specdec.generate(model, PROMPTS, max_new_tokens=64)
    # whole trees: with the cost model's sizing, tau would depend on the machine's measured verify costs
    out = specdec.generate(model, PROMPTS, max_new_tokens=64, drafter=drafter, return_dict=True, speculation="always")
    assert out.sequences == plain and out.tau > 1.2
    hidden, tree = next((h, t) for h, t in drafter.seen if h is not None)
    root_choice = int((hidden @ model.lm_head.weight.detach().T).argmax())
    assert int(tree.tokens[0]) == root_choice  # head 0 through the target's (untied) LM head


def test_generate_and_cli_by_name_with_a_path(tmp_path, capsys):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specdec.cli import main

    model = build_tiny_model("llama-mha-untied", vocab_size=96)
    write_published_checkpoint(tmp_path / "h", 2, 1, 64, 96, lm_head=model.lm_head.weight.detach(),
                               config_extra={"medusa_choices": [[0], [0, 0]]})
    plain = specdec.generate(model, PROMPTS, max_new_tokens=32)
    assert specdec.generate(model, PROMPTS, max_new_tokens=32, drafter="medusa",
                            drafter_options={"path": str(tmp_path / "h")}) == plain
    model.save_pretrained(tmp_path / "model")
    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]")),
                            unk_token="[UNK]").save_pretrained(tmp_path / "model")
    summaries = []
    for extra in ([], ["--drafter", "medusa", "--drafter-option", f"path={tmp_path / 'h'}"],
                  ["--drafter", "medusa", "--drafter-option", f"path={tmp_path / 'h'}",
                   "--drafter-option", "tree=dynamic", "--drafter-option", "max_nodes=3"]):
        assert main(["generate", "--model", str(tmp_path / "model"), "--no-chat-template", "--max-new-tokens", "24",
                     "--json", *extra, "the cat sat"]) == 0
        doc = json.loads(capsys.readouterr().out)  # --json: stdout is one document, the text and the summary
        summaries.append((doc.pop("text"), doc))
    assert summaries[1][1]["drafter"] == "medusa" and summaries[1][1]["tau"] >= 1.0
    assert summaries[0][0] == summaries[1][0] == summaries[2][0]  # greedy text identical to plain decoding


# ---- sampling: exact through the rejection sampler -----------------------------------------------
def _first_tokens(model, drafter, seed, rule=EXACT):
    out = generate_with_control(model, [[1, 2, 3, 1, 2, 3, 1, 2]] * 6000, rule, max_new_tokens=3, drafter=drafter,
                                do_sample=True, seed=seed, temperature=0.9, top_k=3, return_dict=True,
                                speculation="always")  # drafts verified whole: the law is tested on them
    return [tuple(t[:3]) for t in out.new_tokens], out.tau


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(tree="dynamic", max_nodes=6), dict(medusa_choices=[[0], [1], [0, 0]])],
                         ids=["dynamic", "static"])
def test_sampling_law_with_medusa_matches_plain(options):
    from specdec.eval.two_sample import two_sample_chi2

    model = build_tiny_model(vocab_size=4, seed=3)
    plain, _ = _first_tokens(model, None, seed=1)
    spec, tau = _first_tokens(model, MedusaDrafter(heads=lm_head_heads(model, 2), **options), seed=2)
    p, power = two_sample_chi2(plain, spec, tv=0.08)
    assert power >= 0.9 and p > 1e-3, (p, power)
    assert tau > 1.3  # drafts are accepted: the test exercises the deterministic-candidate rule


@pytest.mark.slow
def test_sampling_law_test_catches_a_broken_rule_with_medusa():
    from specdec.eval import negative_controls
    from specdec.eval.two_sample import two_sample_chi2

    model = build_tiny_model(vocab_size=4, seed=3)
    plain, _ = _first_tokens(model, None, seed=1)
    drafter = MedusaDrafter(heads=lm_head_heads(model, 2), tree="dynamic", max_nodes=6)
    broken, _ = _first_tokens(model, drafter, seed=2, rule=negative_controls.BROKEN_RULES["always_accept"])
    assert two_sample_chi2(plain, broken).p_value < 1e-6


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("problem, match", [
    ("hidden", "hidden_size=32.*64"), ("vocab", "vocab_size=50.*96"), ("no-config", "config.json is missing"),
    ("no-weights", "is missing"), ("pickle", "pickles are not loaded"), ("corrupt", "not a readable safetensors"),
    ("truncated", "not a readable safetensors"), ("wrong-keys", "does not match"), ("bad-json", "not valid JSON"),
    ("no-num-heads", "lacks medusa_num_heads"),
    # no residual block: the hidden size is the LM heads' (was torch's state-dict dump, blaming config.json)
    ("hidden-no-blocks", r"h: Medusa heads have hidden_size=32 but the target model has 64$"),
    ("no-dir", r"gone: the directory does not exist"),  # was "medusa_lm_head.safetensors is missing"
])
def test_bad_checkpoints_are_refused_clearly(problem, match, tmp_path):
    path = tmp_path / "h"
    hidden, vocab = (32 if problem.startswith("hidden") else 64), (50 if problem == "vocab" else 96)
    write_published_checkpoint(path, 2, 0 if problem == "hidden-no-blocks" else 1, hidden, vocab)
    if problem == "no-dir":
        path = tmp_path / "gone"
    weights, config = path / "medusa_lm_head.safetensors", path / "config.json"
    if problem == "no-config":
        config.unlink()
    if problem in ("no-weights", "pickle"):
        weights.unlink()
    if problem == "pickle":
        (path / "medusa_lm_head.pt").write_bytes(b"\x80\x04not really")
    if problem == "corrupt":
        weights.write_bytes(b"garbage")
    if problem == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    if problem == "wrong-keys":
        config.write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    if problem == "bad-json":
        config.write_text("{medusa_num_heads: 2")
    if problem == "no-num-heads":
        config.write_text(json.dumps({"medusa_num_layers": 1}))
    with pytest.raises(MedusaCheckpointError, match=match):
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=4, drafter="medusa",
                         drafter_options={"path": str(path)})


@pytest.mark.parametrize("size, match", [
    (dict(hidden_size=32), "hidden_size=32 but the target model has hidden_size=64"),
    (dict(vocab_size=95), "vocab_size=95 but the target model has vocab_size=96"),
])
def test_heads_object_that_does_not_fit_the_target_is_refused(size, match):
    heads = MedusaHeads(MedusaConfig(2, 1, **{"hidden_size": 64, "vocab_size": 96, **size}))
    with pytest.raises(MedusaCheckpointError, match=match):
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=4, drafter=MedusaDrafter(heads=heads))


@pytest.mark.parametrize("choices, match", [
    ([[0], [1, 0]], "lacks its prefix"), ([[0], [0, 0], [0, 0, 0]], "deeper than the 2"), ([], "empty"),
    ([[-1]], ">= 0"), ([[0], [0, "x"]], "integer ranks"), ([[0.5]], "integer ranks"),  # 0.5 was taken as 0
    ([[r] for r in range(65)], "at most 64"),
    ([[0], [200]], "rank 200, but the vocabulary has 96"),
])
def test_bad_medusa_choices_are_refused_before_the_cost_measurement(choices, match, monkeypatch):
    """Choices that do not fit the heads (too deep, a rank beyond their vocabulary) were refused only when the heads
    were attached, after speculation="auto" had measured the verify costs (minutes on a large target)."""
    monkeypatch.setattr("specdec.engine_setup.load_cost_model", no_cost_measurement)
    heads = MedusaHeads(MedusaConfig(2, 1, 64, 96))
    with pytest.raises(ValueError, match=match):
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=4,
                         drafter=MedusaDrafter(heads=heads, medusa_choices=choices), speculation="auto")


def test_top_k_beyond_the_heads_vocabulary_is_refused_before_the_cost_measurement(tmp_path, monkeypatch):
    monkeypatch.setattr("specdec.engine_setup.load_cost_model", no_cost_measurement)
    save_medusa(MedusaHeads(MedusaConfig(2, 1, 64, 96, draft_vocab=[1, 2, 3])), tmp_path / "h")
    with pytest.raises(InputError, match="^medusa: top_k=4 exceeds the draft vocabulary of 3 tokens"):
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=4, drafter="medusa",
                         drafter_options={"path": str(tmp_path / "h"), "tree": "dynamic", "top_k": 4},
                         speculation="auto")


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_a_top_k_above_max_nodes_is_refused(tree):
    """A tree of max_nodes nodes keeps no more than max_nodes tokens of a head under one node (the paths are ranked
    by a product of probabilities, a child never above its parent): a larger top_k drafted the trees of
    top_k=max_nodes without a word (a dynamic tree, and the default static one)."""
    heads = MedusaHeads(MedusaConfig(3, 1, 64, 96))
    with pytest.raises(InputError, match=r"^medusa: top_k=5 exceeds max_nodes=4: .* drafts as top_k=4"):
        MedusaDrafter(heads=heads, tree=tree, top_k=5, max_nodes=4)
    with pytest.raises(InputError, match=r"^medusa: top_k=17 exceeds the default max_nodes=16"):
        MedusaDrafter(heads=heads, tree=tree, top_k=17)
    assert default_choices(3, 4, 9) == default_choices(3, 4, 4)  # the default static tree: the same paths
    logp = [[-(0.3 + 0.2 * d) * r - 0.1 * d for r in range(9)] for d in range(3)]  # head d, rank r: no ties
    trees = [dynamic_tree([list(range(k))] * 3, [row[:k] for row in logp], 4) for k in (4, 9)]
    assert [(t.tokens.tolist(), t.parents.tolist()) for t in trees[:1]] == [(t.tokens.tolist(), t.parents.tolist())
                                                                           for t in trees[1:]]


def test_saved_choices_too_deep_for_the_heads_are_refused(tmp_path):
    write_published_checkpoint(tmp_path / "h", 2, 1, 64, 96, config_extra={"medusa_choices": [[0], [0, 0], [0, 0, 0]]})
    with pytest.raises(ValueError, match=r"\[0, 0, 0\].*num_heads=2"):
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=4, drafter="medusa",
                         drafter_options={"path": str(tmp_path / "h")})


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one of path= .* or heads="), (dict(heads=object()), "MedusaHeads"),
    (dict(path="x", tree="typical"), "'static' or 'dynamic'"), (dict(path="x", max_nodes=65), "<= 64"),
    (dict(path="x", top_k=0), "top_k must be >= 1"), (dict(path="x", medusa_choices="[[0],"), "not a JSON"),
    (dict(path="x", tree="dynamic", medusa_choices=[[0]]), "cannot be used with tree='dynamic'"),
])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        MedusaDrafter(**kwargs)


def test_choices_given_as_json_text_work_like_lists():
    model = build_tiny_model()
    heads = lm_head_heads(model, 2)
    a = Recorder(heads=heads, medusa_choices="[[0], [1], [0, 0]]")
    specdec.generate(model, PROMPTS[:1], max_new_tokens=4, drafter=a)
    assert a.paths == ((0,), (1,), (0, 0))


def test_saver_round_trip_matches_the_independent_layout(tmp_path):
    from specdec.drafters.medusa_heads import save_medusa

    state = write_published_checkpoint(tmp_path / "a", 2, 2, 64, 96)
    heads = load_medusa(tmp_path / "a")
    save_medusa(heads, tmp_path / "b")
    again = load_medusa(tmp_path / "b", hidden_size=64, vocab_size=96)
    for k, v in state.items():
        torch.testing.assert_close(again.heads.state_dict()[k], v)


def test_loaded_heads_are_owned_not_views_of_the_file(tmp_path):
    """Heads are built on the meta device and take the file's tensors: copies, so heads overwritten in place
    (a training run saving again) do not change a loaded drafter."""
    write_published_checkpoint(tmp_path / "a", 2, 1, 64, 96)
    heads = load_medusa(tmp_path / "a")
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    write_published_checkpoint(tmp_path / "b", 2, 1, 64, 96, seed=1)
    with open(tmp_path / "a" / "medusa_lm_head.safetensors", "r+b") as f:  # in place: same inode, same length
        f.write((tmp_path / "b" / "medusa_lm_head.safetensors").read_bytes())
    for k, v in heads.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("extra, match", [
    ({"medusa_num_heads": "two"}, r"config.json: medusa_num_heads must be an integer, got 'two'"),
    ({"medusa_num_layers": 1.5}, r"config.json: medusa_num_layers must be an integer, got 1.5"),
    ({"hidden_size": [64]}, r"config.json: hidden_size must be an integer, got \[64\]"),
    ({"medusa_choices": [["a"]]}, r"config.json: medusa_choices must be a list of lists of integer ranks"),
    ({"medusa_choices": [1, 2]}, r"config.json: medusa_choices must be a list of top-k paths .*, got \[1, 2\]$"),
    # a string was split into characters, an int gave "config.json: 'int' object is not iterable"
    ({"medusa_choices": "[[0],[1]]"}, r"config.json: medusa_choices must be a list of top-k paths .*, got '\[\[0\],"),
    ({"medusa_choices": 5}, r"config.json: medusa_choices must be a list of top-k paths .*, got 5$"),
])
def test_non_integer_config_fields_name_the_file(extra, match, tmp_path):
    """A bare ValueError without the file's name (or, for 1.5, a silently truncated count) before."""
    write_published_checkpoint(tmp_path / "h", 2, 1, 64, 96, config_extra=extra)
    with pytest.raises(MedusaCheckpointError, match=match):
        load_medusa(tmp_path / "h", 64, 96)


@pytest.mark.parametrize("holds", ["vllm", "model"])
def test_a_directory_of_vllm_heads_or_a_model_is_named_for_what_it_holds(holds, tmp_path):
    """Both were told to run convert-medusa ("the heads may be inside the model's weights"), which refuses them."""
    from specdec.drafters.export_head import export_head
    from specdec.drafters.medusa_heads import save_medusa

    if holds == "vllm":  # specdec's own export for vLLM
        save_medusa(MedusaHeads(MedusaConfig(2, 2, 64, 96)), tmp_path / "heads")
        export_head(tmp_path / "heads", "vllm", tmp_path / "out", target="a/b")
        match = r"out holds vLLM's Medusa serving layout .* specdec does not read back: pass the directory it was"
    else:
        build_tiny_model().save_pretrained(tmp_path / "out")
        match = r"out holds a model's weights but no Medusa heads: pass the heads' directory"
    with pytest.raises(MedusaCheckpointError, match=match) as err:
        load_medusa(tmp_path / "out")
    assert "`specdec convert-medusa" not in str(err.value)


def test_a_path_drafter_reused_with_a_target_of_another_dtype_leaves_the_shared_heads_as_loaded(tmp_path):
    """Heads loaded from a path are shared per (target shape, dtype, device) by every drafter of that checkpoint
    (drafters/loaded_once.py): a drafter object reused with a bfloat16 target moved the float32 target's shared
    heads to bfloat16 (``.to()`` in place), under every other drafter holding them. Each call now takes the heads
    loaded for its own target."""
    model = build_tiny_model("llama-mha-untied", vocab_size=96)
    write_published_checkpoint(tmp_path / "h", 2, 1, 64, 96, lm_head=model.lm_head.weight.detach())
    drafter = MedusaDrafter(path=str(tmp_path / "h"))
    plain = specdec.generate(model, PROMPTS, max_new_tokens=8)
    assert specdec.generate(model, PROMPTS, max_new_tokens=8, drafter=drafter) == plain
    shared = drafter.heads
    half = build_tiny_model("llama-mha-untied", vocab_size=96).to(torch.bfloat16)
    specdec.generate(half, PROMPTS, max_new_tokens=8, drafter=drafter)
    assert drafter.heads is not shared and next(shared.parameters()).dtype == torch.float32
    assert specdec.generate(model, PROMPTS, max_new_tokens=8, drafter=MedusaDrafter(path=str(tmp_path / "h"))) == plain


def test_given_heads_of_another_dtype_are_refused_not_converted_for_good():
    """heads= were converted to the target's dtype in place: float32 heads used once with a bfloat16 target came
    back bfloat16 (logged at info level only)."""
    model = build_tiny_model("llama-mha-untied", vocab_size=96)
    heads = MedusaHeads(MedusaConfig(2, 1, 64, 96))
    with pytest.raises(specdec.InputError, match=r"^medusa: the heads= given is in torch.float32 but the target "
                                                 r"runs in torch.bfloat16: convert it first"):
        specdec.generate(model.to(torch.bfloat16), PROMPTS, max_new_tokens=4, drafter=MedusaDrafter(heads=heads))
    assert all(p.dtype == torch.float32 for p in heads.parameters())


def test_the_heads_draft_without_an_autograd_graph():
    """Medusa's propose() lost its torch.inference_mode() to a method inserted under the decorator: every draft step
    recorded an autograd graph through heads whose weights require grad."""
    model = build_tiny_model()
    heads = MedusaHeads(MedusaConfig(2, 1, model.config.hidden_size, model.config.vocab_size))
    seen = []
    heads.heads[0].register_forward_hook(lambda module, args, out: seen.append(torch.is_inference_mode_enabled()))
    specdec.generate(model, [[1, 2, 3, 4]], max_new_tokens=4, drafter=MedusaDrafter(heads=heads, tree="dynamic"),
                     speculation="always")
    assert seen and all(seen)
