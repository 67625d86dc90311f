"""What structured output costs a decode step: the engine in-process, unconstrained against
constrained, at each batch size, and the mask's two parts on their own.

    python benchmarks/structured_output.py [--model smollm2-135m] [--batches 1 64] [--tokens 16] [--rounds 3]
        [--device cuda --dtype bfloat16 --tokenizer FOLDER]   # e.g. dummy:llama-3.1-8b on a GPU

A run is B requests decoding --tokens tokens (greedy, EOS ignored) after a short prompt; the
constrained run gives every request a JSON Schema (an object with a free string, so it never
ends early). Printed per batch size: ms per decode step unconstrained and constrained, and per
step the mask's fill (llguidance, on the host) and apply (unpack + masked_fill on the logits'
device), measured apart on the matchers' states along a real answer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.llm_engine import LLMEngine  # noqa: E402
from worker.engine.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from worker.engine.structured_output import grammar_mask  # noqa: E402

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "note": {"type": "string"}},
          "required": ["id", "note"], "additionalProperties": False}

TYPICAL = {
    "object with 4 typed fields": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags"],
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                       "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,}$"},
                       "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}}},
    "nested order (items, address, enums)": {
        "type": "object", "required": ["id", "items", "ship_to", "status"],
        "properties": {"id": {"type": "integer"}, "status": {"enum": ["new", "paid", "shipped"]},
                       "items": {"type": "array", "minItems": 1, "items": {
                           "type": "object", "required": ["sku", "qty"],
                           "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}}},
                       "ship_to": {"type": "object", "required": ["street", "city", "zip"], "properties": {
                           "street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
}


def decode_ms(engine: LLMEngine, batch: int, tokens: int, so: StructuredOutput | None) -> float:
    """Mean ms of the decode steps (the prefill step left out)."""
    prompt = engine.tokenize(messages=[{"role": "user", "content": "Describe a cat as JSON."}])
    for _ in range(batch):
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                                  structured_output=so))
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * sum(times) / len(times)


def mask_ms(engine: LLMEngine, batch: int, so: StructuredOutput, steps: int) -> tuple[float, float]:
    """Mean ms per step to fill and to apply the masks of ``batch`` matchers along one answer."""
    matchers = [engine.grammars.matcher(so) for _ in range(batch)]
    answer = engine.tokenizer.encode('{"id":42,"note":"a small grey cat that sleeps all day"}',
                                     add_special_tokens=False)[:steps]
    logits = torch.randn(batch, engine.model_config.vocab_size, device=engine.config.device)
    fill = apply = 0.0
    for token in answer:
        t0 = time.perf_counter()
        mask = grammar_mask(matchers, engine.model_config.vocab_size)
        t1 = time.perf_counter()
        mask.apply(logits.clone())
        if logits.is_cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        fill, apply = fill + t1 - t0, apply + t2 - t1
        for m in matchers:
            m.consume_token(token)
    return 1e3 * fill / len(answer), 1e3 * apply / len(answer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none",
                    help="weights: none (the GGUF dequantized, as recorded) or auto (packed, the serving default)")
    ap.add_argument("--tokenizer", default=None, help="for dummy: models (a tokenizer folder)")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=max(args.batches), device=args.device,
                                    dtype=args.dtype, quantization=args.quantization, tokenizer=args.tokenizer))
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    start = time.perf_counter()
    engine.grammars.matcher(so)
    print(f"first matcher (llguidance tokenizer + grammar): {time.perf_counter() - start:.2f} s")
    for name, schema in TYPICAL.items():  # a new spec at admission: grammar + matcher, no cache
        start = time.perf_counter()
        engine.grammars.matcher(StructuredOutput("json_schema", json.dumps(schema)))
        print(f"compile {name}: {1e3 * (time.perf_counter() - start):.2f} ms")
    decode_ms(engine, 1, 4, so)  # warm-up
    print("batch  step_ms_free  step_ms_constrained  mask_fill_ms  mask_apply_ms  (medians)")
    for batch in args.batches:
        # Interleaved rounds, medians: a shared machine's noise hits both alike.
        free, constrained, fill, apply = [], [], [], []
        for _ in range(args.rounds):
            free.append(decode_ms(engine, batch, args.tokens, None))
            constrained.append(decode_ms(engine, batch, args.tokens, so))
            f, a = mask_ms(engine, batch, so, args.tokens)
            fill.append(f)
            apply.append(a)
        free, constrained, fill, apply = map(statistics.median, (free, constrained, fill, apply))
        print(f"{batch:5d}  {free:12.1f}  {constrained:19.1f}  {fill:12.2f}  {apply:13.2f}", flush=True)


if __name__ == "__main__":
    main()
