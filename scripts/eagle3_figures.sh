#!/usr/bin/env bash
# Issue 29 figures: an EAGLE-3 head trained by `distill` against another head, back to back on the same
# prompts, then vLLM's eagle3 on the exported head (bash run.sh vllm first). Run from the repository root,
# on a machine nothing else is using (the figures are timed). LIMIT=N (and MAX_NEW_TOKENS=M) shorten it to check the script.
# E3 (default out/draft-eagle3, else the shipped head) is the EAGLE-3 head; SHIPPED (default specdemo/data/smollm2-135m-draft)
# the head it is compared with. The run of 2026-12-02 (bench/eagle3, docs/eagle3.md) had the EAGLE-style head shipped
# until then as SHIPPED; it is in git history: git archive 4595cf7 assets/smollm2-135m-draft | tar -x -C /tmp (that head
# is retired and only the code at 1cb37f1 loads it: docs/notes/eagle-style-head.md)
set -euo pipefail
P=${PYTHON:-.venv/bin/python}
SHIPPED=${SHIPPED:-specdemo/data/smollm2-135m-draft}
E3=${E3:-$( [ -f out/draft-eagle3/config.json ] && echo out/draft-eagle3 || echo specdemo/data/smollm2-135m-draft )}
OUTDIR=${OUTDIR:-bench/eagle3}
LIM=(); [ -n "${LIMIT:-}" ] && LIM=(--limit "$LIMIT")
[ -n "${MAX_NEW_TOKENS:-}" ] && LIM+=(--max-new-tokens "$MAX_NEW_TOKENS")  # a check of the script: LIMIT=1 MAX_NEW_TOKENS=16
mkdir -p "$OUTDIR"
echo "shipped: $SHIPPED  eagle3: $E3  out: $OUTDIR  ${LIMIT:+limit $LIMIT}"

# 1. agreement at draft steps 1-3 (teacher-forced, no timing), both heads over the same target answers
$P -m specdemo distill agreement --draft "$SHIPPED" "$E3" "${LIM[@]}" --out "$OUTDIR/agreement-dev.md"
$P -m specdemo distill agreement --draft "$SHIPPED" "$E3" "${LIM[@]}" --prompts specdemo/data/prompts/independent.jsonl \
  --out "$OUTDIR/agreement-independent.md"

# 2. the draft alone, k = 1..3, back to back (c and the best k come from each report's theory section)
$P -m specdemo bench --draft "$SHIPPED" --k 1,2,3 "${LIM[@]}" --out "$OUTDIR/shipped-k1-3" --quiet
$P -m specdemo bench --draft "$E3" --k 1,2,3 "${LIM[@]}" --out "$OUTDIR/eagle3-k1-3" --quiet

# 3. the hybrid (prompt lookup where the context repeats, else the draft), k = 8
$P -m specdemo bench --drafter hybrid --draft "$SHIPPED" --k 8 "${LIM[@]}" --out "$OUTDIR/shipped-hybrid-k8" --quiet
$P -m specdemo bench --drafter hybrid --draft "$E3" --k 8 "${LIM[@]}" --out "$OUTDIR/eagle3-hybrid-k8" --quiet

# 4. vLLM: the exported head in vLLM's eagle3 beside our drafter on the same head (greedy identity, acceptance)
$P -m specdemo export --draft "$E3" --out "$OUTDIR/export" --k 2
# vLLM has no confidence gate: switch ours off for this comparison, so both engines draft k tokens every step
$P -c "import json, sys; p = sys.argv[1]; m = json.load(open(p)); m.pop('min_confidence', None); json.dump(m, open(p, 'w'))" \
  "$OUTDIR/export/specdemo.json"
# (10 prompts, 64 tokens: vLLM loads the pair once per configuration, about a minute each on the CPU)
VLIM=(--limit "${LIMIT:-10}" --max-new-tokens "${MAX_NEW_TOKENS:-64}")
$P -m specdemo bench --draft "$OUTDIR/export" --k 2 "${VLIM[@]}" --anchors vllm --out "$OUTDIR/vllm-eagle3" --quiet

# the numbers
$P - "$OUTDIR" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print((out / "agreement-dev.md").read_text())
print((out / "agreement-independent.md").read_text())
for name in ("shipped-k1-3", "eagle3-k1-3", "shipped-hybrid-k8", "eagle3-hybrid-k8", "vllm-eagle3"):
    r = json.loads((out / name / "bench.json").read_text())
    o, t = r["overall"], r.get("theory") or {}
    by_k = {k: (round(a["speedup"], 3), round(a["mean_accepted"], 2), round(a["acceptance_rate"], 3))
            for k, a in r["by_k"].items()}
    print(name, "speedup", round(o["speedup"], 3), "AR tok/s", round(o["ar_tokens_per_s"], 1), "identical",
          o["identical_fraction"], "| by k (speedup, tokens/pass, acceptance):", by_k, "| c:", t.get("c"),
          "best measured k:", t.get("best_measured_k"))
    v = (r.get("anchors") or {}).get("vllm")
    if v:
        print("  vLLM eagle3 acceptance", v.get("eagle3_acceptance_rate"), "ours", v.get("ours_acceptance_rate"),
              "vLLM mean accepted", v.get("eagle3_mean_accepted"), "ours", v.get("ours_mean_accepted"),
              "identical vLLM eagle3", v.get("eagle3_identical_fraction"), "plain", v.get("plain_identical_fraction"))
PY
