"""One read of the device per greedy speculative step (issue 49): a drafter's greedy chains stay on the device
(Drafter.propose_on_device: the EAGLE-3 head's over its static cache, a draft LM's), the target verifies them there,
and the verdicts and the chains come back in one copy (verify.read_chains). On the CPU, with the path forced
on (loop.ONE_READ = "always"; by default it runs under a graph-captured target): every step reads once, and the
drafts, their q and the output are those of the usual path, which are the target's own greedy tokens."""

import pytest
from conftest import TEST_DEVICE, case, drafter_cases, sampled_second_tokens, second_token_distribution
from test_draft_graphs import HOST_READS, PROMPTS, counted_reads

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.engine import decode, graphs, loop, row_outputs


@pytest.fixture
def step_reads(monkeypatch) -> list[list[tuple[str, str]]]:
    """Each speculative step's reads of the device, as (file, function) of the caller, from now on in the test (the
    static head cache's reads of host tensors left out: HOST_READS)."""
    per_step, step = [], loop._spec_step

    def counting(*args):
        with counted_reads() as reads:
            out = step(*args)
        per_step.append([(where.rsplit("/", 1)[-1], name) for where, name in reads
                         if (where.rsplit("/", 1)[-1], name) not in HOST_READS])
        return out

    monkeypatch.setattr(loop, "_spec_step", counting)
    return per_step


def run(tiny, tiny_tok, kind, rows, k, mode, monkeypatch, min_confidence=0.0, sampling=SamplingConfig()):
    """(each step's drafted tokens, accepted count and tokens; the drafts' q; the rows' outputs) of a fresh drafter's
    decode (greedy unless told) with loop.ONE_READ = mode."""
    monkeypatch.setattr(loop, "ONE_READ", mode)
    target, drafter = case(kind).build(tiny)
    if min_confidence:
        drafter.min_confidence = min_confidence
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=k, tree="off", sampling=sampling)
    with drafter.paused():  # what it keeps across requests (suffix decoding's cache) the same in both runs
        events = list(decode(target, tiny_tok, PROMPTS[:rows], config, drafter))
    steps = [(s.drafted, s.num_accepted, s.tokens, s.draft_source) for e in events for s in e.steps]
    q = [p for e in events for s in e.steps for p in (s.draft_token_probs or [])]
    return steps, q, row_outputs(events, rows)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["model", "eagle3", "eagle3-unsure", "hybrid", "hybrid-eagle3", "hybrid-suffix"])
def test_chains_verified_on_the_device_are_the_usual_path(tiny, tiny_tok, tiny_runner, kind, k, rows, monkeypatch):
    """Step for step the same drafts (rows stopping at their k, at an end of sequence, or, for the head with a
    confidence stop, before an unsure token; a hybrid's rows from its lookup or its draft, each named so), the same
    accepted counts and tokens, the same q; the output is the target's own greedy output (the autoregressive
    run's)."""
    name, unsure = kind.removesuffix("-unsure"), 0.6 if kind.endswith("-unsure") else 0.0
    if name == "eagle3" and tiny_runner == "eager":
        pytest.skip("the head's eager cache drafts on the host (propose_on_device needs its static cache)")
    usual = run(tiny, tiny_tok, name, rows, k, "never", monkeypatch, unsure)
    device = run(tiny, tiny_tok, name, rows, k, "always", monkeypatch, unsure)
    assert device[0] == usual[0] and device[2] == usual[2]
    assert device[1] == pytest.approx(usual[1], abs=1e-6)
    target = case(name).build(tiny)[0]
    plain = list(decode(target, tiny_tok, PROMPTS[:rows], GenerationConfig(max_new_tokens=24)))
    assert device[2] == row_outputs(plain, rows)
    if name.startswith("hybrid"):  # the draft's rows and prompt lookup's (suffix decoding's cache, shared across
        # the tests, may serve every row from earlier answers)
        sources = {source for *_, source in device[0]} - {None}  # None: the prefill
        assert sources == {"model", "lookup"} if name != "hybrid-suffix" else sources, sources
        return
    lengths = {len(d) for d, *_ in device[0] if d}
    assert (max(lengths) == k or unsure) and (k == 1 or len(lengths) > 1 or name == "model")  # some stopped short


@pytest.mark.parametrize("rule", ["greedy", "token", "block"])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("kind", ["model", "eagle3", "hybrid", "hybrid-eagle3"])
def test_a_step_reads_the_device_once(tiny, tiny_tok, kind, rows, rule, monkeypatch, step_reads):
    """Under the static runner every speculative step of a k = 4 decode (rejections, rows leaving, k shrinking at
    the end) reads values back once in all: the verdicts and the chains together, greedy or sampled (the draws made
    on the device from each row's generator, rejection sampling or block verification there too; a hybrid's lookup
    rows beside them). The usual path reads twice greedy (the drafts, then the verdicts), and more sampled (a drafted
    token a read)."""
    sampled = rule != "greedy"
    models = (tiny.target, tiny.draft, tiny.eagle3_target)
    for model in models:
        graphs.attach(model, "on")
    per_step = step_reads
    sampling = SamplingConfig(temperature=1.0, top_p=0.9, verification=rule) if sampled else SamplingConfig()
    try:
        for mode, reads in (("always", 1), ("never", 2)):
            per_step.clear()
            run(tiny, tiny_tok, kind, rows, 4, mode, monkeypatch, sampling=sampling)
            assert len(per_step) >= 3
            counts = [len(r) for r in per_step]  # the last step may have nothing to draft: its verdicts alone
            if mode == "never" and sampled:
                assert max(counts) > 2
                continue
            # the usual path reads the verdicts alone where a hybrid's lookup served every row
            least = 1 if mode == "never" and kind.startswith("hybrid") else len(counts) - 1
            assert set(counts) <= {1, reads} and counts.count(reads) >= least, per_step
            if mode == "always":  # a step with nothing to draft (k = 0 at the end) reads its verdicts alone
                names = [name for r in per_step for _, name in r]
                assert set(names) <= {"read_chains", "greedy_accept_batch", "sampled_accept_batch"}
                assert names.count("read_chains") >= len(names) - 1
    finally:
        for model in models:
            graphs.detach(model)


@pytest.mark.parametrize("rule", ["token", "block"])
@pytest.mark.parametrize("kind", ["model", "eagle3", "hybrid", "hybrid-eagle3"])
def test_sampled_chains_verified_on_the_device_keep_the_targets_distribution(tiny, tiny_tok, kind, rule, monkeypatch):
    """Sampled chains drawn and verified on the device (the draft's draws from each row's generator, the head's over
    its draft vocabulary; a hybrid's lookup rows one-hot beside them; rejection sampling or block verification there,
    verify.ROW_RULES) give the second token the target's distribution, far from the draft's, as test_engine's check
    of every drafter does on the usual path (its bound and trials)."""
    prompt = list(range(1, 16)) + [3]
    models = (tiny.target, tiny.draft, tiny.eagle3_target)
    for model in models:
        graphs.attach(model, "on")
    monkeypatch.setattr(loop, "ONE_READ", "always")
    on_device, verify = [], loop.verify_chains_on_device
    monkeypatch.setattr(loop, "verify_chains_on_device",
                        lambda *a: on_device.append(any(h and h.tokens for h in a[2].held or [])) or verify(*a))
    try:
        target = case(kind).build(tiny)[0]
        config = GenerationConfig(max_new_tokens=3, num_draft_tokens=2, sampling=SamplingConfig(1.0, verification=rule))
        counts, proposals = sampled_second_tokens(target, tiny_tok, lambda: case(kind).build(tiny)[1], prompt, config,
                                                  2000)
        expected, draft = second_token_distribution(target, prompt), second_token_distribution(tiny.draft, prompt)
    finally:
        for model in models:
            graphs.detach(model)
    empirical = counts / counts.sum()
    assert counts.sum() > 0.9 * 2000 and proposals > 2000 // 4 and len(on_device) >= 50
    assert any(on_device) == kind.startswith("hybrid")  # a hybrid's steps with lookup rows among them
    assert 0.5 * float((empirical - expected).abs().sum()) < 0.06
    if kind == "model":
        assert 0.5 * float((draft - expected).abs().sum()) > 0.15


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="CUDA's sync debug mode: scripts/gpu_check.sh (GRAPH_TESTS=1)")
@pytest.mark.parametrize("kind,tree,temperature,rule", [
    ("model", "off", 0.0, "token"), ("eagle3", "off", 0.0, "token"), ("eagle3", "8", 0.0, "token"),
    ("eagle3", "auto", 0.0, "token"), ("model", "off", 1.0, "token"), ("eagle3", "off", 1.0, "token"),
    ("model", "off", 1.0, "block"), ("eagle3", "off", 1.0, "block"), ("hybrid", "off", 0.0, "token"),
    ("hybrid-eagle3", "off", 1.0, "token")])
def test_a_captured_step_synchronises_once(tiny, tiny_tok, kind, tree, temperature, rule, monkeypatch):
    """Under CUDA graphs (the default: loop.ONE_READ = "capture") every speculative step after the first few
    synchronises the host with the device once, by CUDA's own count (torch.cuda.set_sync_debug_mode, which sees
    implicit waits only); a failure lists where the others happen. Besides it the step waits explicitly at its
    clock's start and stop only (torch.cuda.synchronize, counted). A head's greedy draft tree of a fixed budget
    grows on the device (eagle3_device_tree) and comes back with the verdict, as a chain does; under --tree auto too
    (cut there, its pass sized by the trees read before: loop.auto_width). Sampled chains too: drawn and verified on
    the device, token-wise or by block verification."""
    import warnings

    import torch

    models = (tiny.target, tiny.draft, tiny.eagle3_target)
    for model in models:
        graphs.attach(model, "on")
    target, drafter = case(kind).build(tiny)
    if tree == "auto":  # pass costs to size the trees by (auto drafts chains without)
        drafter.pass_costs = {n: 1.0 + 0.02 * n for n in range(1, 17)}
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, tree=tree,
                              sampling=SamplingConfig(temperature=temperature, verification=rule))
    syncs, explicit, synchronize = [], [], torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: explicit.append(a) or synchronize(*a))
    try:
        events = decode(target, tiny_tok, PROMPTS[:4], config, drafter)
        next(events)  # the prefill
        while True:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    event = next(events)
                except StopIteration:
                    break
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs.append((event.kind, [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)],
                          len(explicit) // torch.cuda.device_count()))
            explicit.clear()
        captured = graphs.runner_of(target).graphs
    finally:
        for model in models:
            graphs.detach(model)
    assert captured > 0  # the uncaptured static code reads once a step too
    steady = [(s, n) for kind_, s, n in syncs[3:] if kind_ == "spec"]
    assert steady and all(len(s) <= 1 and n <= 2 for s, n in steady), syncs


@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_sampled_tree_step_reads_its_verdicts_once(tiny, tiny_tok, rows, kind, monkeypatch, step_reads):
    """Under the static runner, sampled trees are verified for every row at once on a GPU (forced here): a host
    drafter's (prompt lookup's branches, one-hot q) read the device once a step (tree_accept_batch;
    sampled_accept_batch where no row branched), where the walk down each tree reads a value per tried child. The
    head's trees, drawn depth by depth on the host, read twice a depth for all rows (what the allotment weighs, what
    was drawn) and their q once, where they read a few values per node and row."""
    monkeypatch.setattr(loop, "ONE_READ", "always")  # as on a GPU (on a CPU the walk goes row by row)
    for model in (tiny.target, tiny.eagle3_target):
        graphs.attach(model, "on")
    try:
        target, drafter = case(kind).build(tiny)
        config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, tree="8", sampling=SamplingConfig(1.0))
        events = list(decode(target, tiny_tok, PROMPTS[:rows], config, drafter))
    finally:
        for model in (tiny.target, tiny.eagle3_target):
            graphs.detach(model)
    assert any(s.parents is not None and s.parents != list(range(-1, len(s.parents) - 1))
               for e in events for s in e.steps)  # some steps branched
    verdicts = {"tree_accept_batch", "sampled_accept_batch"}
    per_step = [[name for _, name in reads] for reads in step_reads]
    if kind == "ngram":
        assert per_step and all(len(names) == 1 for names in per_step), per_step
        assert {n for names in per_step for n in names} == verdicts
        return
    assert per_step and all(len(names) <= 2 * 4 + 2 for names in per_step), per_step
    assert {n for names in per_step for n in names} <= verdicts | {"_tops", "_draws", "_sampled_proposals"}


@pytest.mark.parametrize("rule", ["greedy", "token", "block"])
@pytest.mark.parametrize("drafter_case", drafter_cases(), ids=str)
def test_every_drafter_reads_the_device_once_a_step(tiny, tiny_tok, drafter_case, rule, monkeypatch, step_reads):
    """Under the static runner with one read forced on (as under CUDA graphs), every registered drafter's chains
    (4 rows, k = 4), greedy or sampled under either rule, read the device once a step: device chains with their
    verdicts (read_chains), a host drafter's verdicts alone."""
    models = (tiny.target, tiny.draft, tiny.eagle3_target)
    for model in models:
        graphs.attach(model, "on")
    monkeypatch.setattr(loop, "ONE_READ", "always")
    sampling = SamplingConfig() if rule == "greedy" else SamplingConfig(1.0, verification=rule)
    try:
        target, drafter = drafter_case.build(tiny)
        config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, tree="off", sampling=sampling)
        with drafter.paused():
            list(decode(target, tiny_tok, PROMPTS[:4], config, drafter))
    finally:
        for model in models:
            graphs.detach(model)
    assert len(step_reads) >= 3 and all(len(reads) == 1 for reads in step_reads), step_reads


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="CUDA events: scripts/gpu_check.sh runs this (GRAPH_TESTS=1)")
def test_the_clock_times_a_steps_drafting_by_events_without_waiting():
    """On CUDA the engine's clock marks where a step's drafting ends with an event on the stream (no wait there: the
    step's read is its one synchronisation besides the clock's stop), read after stop: two kernels of about the same
    length before and after the mark give a first phase of about half the whole."""
    import torch

    from specdemo.engine.timing import Clock

    clock = Clock(TEST_DEVICE)
    clock.start()
    torch.cuda._sleep(50_000_000)  # tens of milliseconds on the stream, queued at once
    clock.split()
    torch.cuda._sleep(50_000_000)
    total = clock.stop()
    assert 0.25 * total < clock.first < 0.75 * total, (clock.first, total)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_plain_step_reads_the_device_once_at_any_batch(tiny, tiny_tok, temperature, monkeypatch):
    """Plain decoding of 4 rows over the static cache, greedy or sampled (each row from its own generator): one read
    of the device a step, every row's token in it."""
    graphs.attach(tiny.target, "on")
    per_step, step = [], loop._ar_step

    def counting(*args):
        with counted_reads() as reads:
            out = step(*args)
        per_step.append([f for path, f in reads if "/specdemo/" in path])
        return out

    monkeypatch.setattr(loop, "_ar_step", counting)
    config = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(temperature=temperature))
    try:
        list(decode(tiny.target, tiny_tok, PROMPTS[:4], config))
    finally:
        graphs.detach(tiny.target)
    assert len(per_step) > 5 and all(reads == ["_choose"] for reads in per_step), per_step
