"""The prepared GPU check: run it on a lent CUDA machine with `bash scripts/gpu_check.sh`.

The bundled weights (98 MB GGUF) exceed what travels to the device (64 MiB), so the check builds a model with
SmolLM2-135M's exact shapes (seeded random weights; `--model DIR` uses real weights where a folder exists) and:
1. greedy losslessness in bf16 on CUDA (self-draft, perturbed draft, prompt lookup), reporting the target's
   top-2 logit gap at the first differing token of any mismatch;
2. timings: our AR loop vs transformers' generate, the verify-pass cost for k + 1 tokens, and the hybrid's model cap
   that those costs give (hybrid.hybrid_model_k);
3. both again under the graph runner (engine.graphs: CUDA graphs over the static KV cache; `--graphs off` skips it),
   with its capture time, the AR loop at batch 1 and 32, and greedy output against the eager engine's.
Writes a JSON report to $OUT/gpu_check.json (or ./gpu_check.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdemo.config import GenerationConfig, runtime_from_env  # noqa: E402
from specdemo.drafters import ModelDrafter, NgramDrafter  # noqa: E402
from specdemo.drafters.hybrid import hybrid_model_k  # noqa: E402
from specdemo.engine import autoregressive, decode, generated_ids, graphs, speculative  # noqa: E402
from specdemo.engine.kv import with_cache  # noqa: E402
from specdemo.measure.compare import first_mismatch  # noqa: E402
from specdemo.models import kernels  # noqa: E402
from specdemo.models.loading import LoadedModel  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def build(dtype, device, folder: str | None, layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    # as load_model does
    kernels.plan_free_attention(torch.device(device), keep_cudnn=runtime_from_env(os.environ).cudnn_sdpa)
    if folder:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers})).to(dtype)
    return model.to(device).eval()


class _IdTokenizer:
    """Enough of a tokenizer for the engine when only ids matter (random weights make text meaningless)."""

    eos_token_id = 2
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t


def ar_timing(target, tok, ids: list[int], new: int, cfg: GenerationConfig) -> dict:
    """Our AR loop (best of 3, after warm-up runs) against transformers' generate on the same ids, greedy, `new`
    tokens; and our AR at batch 32 (tokens per second over all rows)."""
    x = torch.tensor([ids], device=target.device)
    for _ in range(2):
        list(autoregressive(target, tok, ids, cfg))
        target.generate(x, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    ours = min(list(autoregressive(target, tok, ids, cfg))[-1].elapsed for _ in range(3))
    hf = min(timed(lambda: target.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False))[1]
             for _ in range(3))
    batch = [ids] * 32
    list(decode(target, tok, batch, cfg, text=False))
    wide = min(list(decode(target, tok, batch, cfg, text=False))[-1].elapsed for _ in range(2))
    return {"ar_tokens_per_s": new / ours, "hf_generate_tokens_per_s": new / hf, "ar_vs_hf_generate": hf / ours,
            "ar_b32_tokens_per_s": 32 * new / wide, "b32_vs_b1": (32 * new / wide) / (new / ours)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a local model folder with real weights (optional)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cuda (the point of this check); cpu only for a dry run")
    ap.add_argument("--layers", type=int, default=30, help="fewer layers for a quick dry run")
    ap.add_argument("--quick", action="store_true", help="two prompts and k = 1, 4 for the losslessness part")
    ap.add_argument("--graphs", default="on", choices=["on", "off"], help="also check the graph runner (default on)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = build(dtype, dev, args.model, args.layers)
    tok = _IdTokenizer()
    if args.model:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
    loaded = LoadedModel("smollm2-135m-shape", target, tok, dev, dtype, "folder")
    perturbed = copy.deepcopy(target)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * p.float().std().to(p.dtype) * 0.3)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (16, 64, 200)]
    prompts.append(prompts[0] * 4)  # repetitive: prompt lookup gets matches
    report = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else str(dev), "dtype": str(dtype),
              "torch": torch.__version__,
              "weights": args.model or "random (SmolLM2-135M shapes)", "lossless": [], "timing": {}}
    cfg = GenerationConfig(max_new_tokens=args.new, num_draft_tokens=4)
    runners = ["eager"] + (["graphs"] if args.graphs == "on" else [])
    reference = {}
    for runner in runners:
        if runner == "graphs":
            start = time.perf_counter()
            graphs.attach(target, "on")
            graphs.attach(perturbed, "on")
        for i, ids in enumerate(prompts[:2] if args.quick else prompts):
            ar = generated_ids(list(autoregressive(target, tok, ids, cfg)))
            reference.setdefault(i, ar)
            for name, drafter in (("self", ModelDrafter(target)), ("perturbed", ModelDrafter(perturbed)),
                                  ("ngram", NgramDrafter())):
                for k in (1, 4) if args.quick else (1, 4, 8):
                    c = GenerationConfig(max_new_tokens=args.new, num_draft_tokens=k)
                    sd = generated_ids(list(speculative(target, tok, drafter, ids, c)))
                    row = {"runner": runner, "prompt": i, "drafter": name, "k": k, "identical": sd == ar,
                           "ar_as_eager": ar == reference[i]}
                    if sd != ar:
                        row["mismatch"] = first_mismatch(loaded, ids, ar, sd)
                    report["lossless"].append(row)
        if runner == "graphs":
            report["timing"]["graphs_first_runs_seconds"] = time.perf_counter() - start  # captures included
            report["timing"]["graphs_runner"] = graphs.describe(target)
        report["timing"][runner] = ar_timing(target, tok, prompts[1], args.new, cfg)
    for runner in runners[1:]:
        report["timing"][f"{runner}_vs_eager_ar"] = (report["timing"][runner]["ar_tokens_per_s"]
                                                     / report["timing"]["eager"]["ar_tokens_per_s"])
    graphs.detach(target)
    graphs.detach(perturbed)
    ids = prompts[1]
    x = torch.tensor([ids], device=dev)
    from transformers import DynamicCache

    costs = {}
    for k in (0, 1, 2, 4, 8, 16):
        cache = DynamicCache(config=target.config)
        with torch.inference_mode():
            target(input_ids=x, **with_cache(target, cache), use_cache=True)
            n = cache.get_seq_length()
            step = torch.randint(3, 1000, (1, k + 1), device=dev)
            times = []
            for _ in range(10):
                _, t = timed(lambda: target(input_ids=step, **with_cache(target, cache), use_cache=True))
                cache.crop(-(k + 1))
                times.append(t)
        costs[k + 1] = sorted(times)[len(times) // 2]
        assert cache.get_seq_length() == n
    report["timing"]["verify_seconds_by_tokens"] = costs
    report["timing"]["verify_cost_ratio"] = ratio = {t: v / costs[1] for t, v in costs.items()}
    report["timing"]["hybrid_model_k"] = hybrid_model_k(ratio)  # None: the hybrid's model drafts up to k here
    ok = sum(r["identical"] for r in report["lossless"])
    report["lossless_summary"] = f"{ok}/{len(report['lossless'])} identical"
    out = Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "lossless"}, indent=1))
    for r in report["lossless"]:
        if not r["identical"]:
            print("mismatch:", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
