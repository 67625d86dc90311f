"""Greedy tokens and their logprobs on fixed prompts, for an A/B of launch options that must not
change the arithmetic (KVCASCADE_PDL_EARLY, KVCASCADE_GLUON_PDL, ...): run it once per setting,
then --compare. Random (dummy) weights give near-ties, and split-K sums add in any order, so a
sequence may part at a near-tie: the comparison passes where, up to each parting, the two runs'
logprobs agree within --tol and the parting is between two tokens within --tol of each other in
both runs. A race (a kernel reading what is not yet written) moves logprobs by far more.

    KVCASCADE_PDL_EARLY=0 python benchmarks/greedy_tokens.py --quantization int4 --out a.json
    python benchmarks/greedy_tokens.py --quantization int4 --out b.json
    python benchmarks/greedy_tokens.py --compare a.json b.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(args) -> dict:
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, device="cuda", dtype="bfloat16", max_model_len=2048,
                                    max_num_batched_tokens=2048, max_num_seqs=64, quantization=args.quantization))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    shared = [rng.randrange(1000, vocab - 1000) for _ in range(100)]
    prompts = [shared + [rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(1, 200))] for _ in range(8)]
    prompts += [[rng.randrange(1000, vocab - 1000) for _ in range(n)] for n in (1, 7, 64, 300, 900)]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, detokenize=False, logprobs=2)

    def generate(batch: list[list[int]]) -> list[list[list]]:  # per prompt: [token, logprob, top] a step
        ids = [engine.add_request(p, sp) for p in batch]
        steps: dict[str, list] = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                steps[out.request_id] += [[lp.token_id, lp.logprob, lp.top] for lp in out.logprobs or []]
        return [steps[i] for i in ids]

    out = {"alone": [generate([p])[0] for p in prompts[:4]],  # batch 1
           "batched": generate(prompts)}  # up to 13 at once, prefills mixed in
    engine.check_integrity()
    engine.close()
    return out


def compare(a: dict, b: dict, tol: float) -> bool:
    ok = True
    for part in a:
        worst, parted, bad = 0.0, 0, []
        for i, (x, y) in enumerate(zip(a[part], b[part])):
            for step, (sa, sb) in enumerate(zip(x, y)):
                if sa[0] == sb[0]:
                    worst = max(worst, abs(sa[1] - sb[1]))
                    continue
                parted += 1  # a near-tie in both runs: each one's top two within tol
                gaps = [abs(s[2][0][1] - s[2][1][1]) if len(s[2]) > 1 else float("inf") for s in (sa, sb)]
                if max(gaps) > tol:
                    bad.append(f"prompt {i} step {step}: {sa[0]} vs {sb[0]}, top-two gaps {gaps}")
                break
        ok = ok and worst <= tol and not bad
        print(f"{part}: {len(a[part]) - parted}/{len(a[part])} sequences equal; largest logprob difference before "
              f"a parting {worst:.4f}; partings not at a near-tie: {bad or 'none'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar="JSON")
    ap.add_argument("--tol", type=float, default=0.05)
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(Path(f).read_text()) for f in args.compare)
        return 0 if compare(a, b, args.tol) else 1
    Path(args.out).write_text(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
