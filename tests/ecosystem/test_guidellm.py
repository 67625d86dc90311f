"""guidellm (a serving benchmark, from PyPI) against `kvcascade serve`, from its CLI: synthetic chat
prompts, streamed, one at a time, its JSON report read back."""

from __future__ import annotations

import json

import pytest

from tests.ecosystem.conftest import MODEL, counter, new_requests, request_counts, run_tool

REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 32, 12


def backend(url: str) -> str:
    # As users run it: guidellm's default routes, GET {target}/health (vLLM's) first of all.
    return json.dumps({"kind": "openai_http", "target": url, "model": MODEL})


@pytest.mark.slow
def test_guidellm_synchronous_benchmark_completes_every_request(served, tokenizer_dir, tmp_path):
    before, tokens_before = request_counts(served.url), counter(served.url, "kvcascade_completion_tokens")
    run_tool(["guidellm", "run", "--backend", backend(served.url),
              "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
              "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
              "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={REQUESTS}",
              "--output", f"kind=json,path={tmp_path / 'report.json'}", "--disable-console-interactive"],
             cwd=tmp_path, scratch=tmp_path)

    [bench] = json.loads((tmp_path / "report.json").read_text())["benchmarks"]
    m = bench["metrics"]
    assert m["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    # It asks for exactly OUTPUT_TOKENS (max_completion_tokens + ignore_eos) and counts them from the
    # streamed usage: every answer is that long.
    out = m["output_token_count"]["successful"]
    assert out["min"] == out["max"] == OUTPUT_TOKENS
    assert all(r["output"] for r in bench["requests"]["successful"])
    ttft, itl = m["time_to_first_token_ms"]["successful"], m["inter_token_latency_ms"]["successful"]
    assert ttft["count"] == REQUESTS and ttft["min"] > 0 and itl["min"] > 0
    assert m["output_tokens_per_second"]["successful"]["mean"] > 0
    assert ttft["mean"] / 1000 < m["request_latency"]["successful"]["mean"]
    print(f"guidellm synchronous, {REQUESTS} requests: {m['output_tokens_per_second']['successful']['mean']:.1f} "
          f"output tok/s, TTFT mean {ttft['mean']:.0f} ms (p50 {ttft['median']:.0f}), ITL mean {itl['mean']:.0f} ms, "
          f"prompt {m['prompt_token_count']['successful']['mean']:.0f} tokens (chat template included)")
    # The server saw the same: REQUESTS answered, none failed, REQUESTS x OUTPUT_TOKENS tokens made.
    assert new_requests(served.url, before) == {"ok": REQUESTS}
    assert counter(served.url, "kvcascade_completion_tokens") - tokens_before == REQUESTS * OUTPUT_TOKENS
