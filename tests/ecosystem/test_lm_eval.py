"""lm-evaluation-harness against `kvcascade serve`, from its CLI, on the two tiny tasks in tasks/:
its local-completions model on a multiple-choice task (loglikelihood: /v1/completions with
echo + logprobs, token-id prompts, 4 a request, 2 requests at a time) and its
local-chat-completions model on a generate_until task (/v1/chat/completions)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from tests.ecosystem.conftest import MODEL, new_requests, request_counts, run_tool

TASKS = Path(__file__).parent / "tasks"
MC, CHAT = "kvcascade_capitals_mc", "kvcascade_arithmetic_chat"
# lm_eval retries a failed request (tenacity, 3 attempts by default), which would hide a 4xx/5xx:
# with one attempt a failed request fails the run.
ONE_ATTEMPT = "max_retries=1"


def _lm_eval(model: str, model_args: str, task: str, tmp: Path, *flags: str) -> tuple[dict, list[dict]]:
    # cwd: the task YAMLs name their data files relative to it (HF datasets' json loader).
    log = run_tool(["lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks", task,
                    "--include_path", str(TASKS), "--output_path", str(tmp / "out"), "--log_samples", *flags],
                   cwd=TASKS, scratch=tmp)
    for trouble in ("API request failed", "Retry attempt", "Exception:"):
        assert trouble not in log, log[-6000:]
    results = json.loads(next((tmp / "out").glob("*/results_*.json")).read_text())
    samples = [json.loads(line) for line in next((tmp / "out").glob(f"*/samples_{task}_*.jsonl")).open()]
    assert results["n-samples"][task] == {"original": 10, "effective": 10} and len(samples) == 10
    return results["results"][task], sorted(samples, key=lambda s: s["doc_id"])


@pytest.mark.slow
def test_lm_eval_multiple_choice_over_completions_matches_the_servers_own_logprobs(served, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    before = request_counts(served.url)
    args = (f"base_url={served.url}/v1/completions,model={MODEL},tokenizer={tokenizer_dir},"
            f"tokenizer_backend=huggingface,num_concurrent=2,{ONE_ATTEMPT}")
    result, samples = _lm_eval("local-completions", args, MC, tmp_path, "--batch_size", "4")
    # 10 questions x 4 choices, one prompt each, all answered.
    assert new_requests(served.url, before) == {"ok": 40}
    acc = result["acc,none"]
    assert isinstance(acc, float) and 0 <= acc <= 1

    # Our own scoring: each context + choice as one text prompt (the server tokenizes it), echo +
    # logprobs, summed over the choice's tokens; the choice with the highest sum is the answer.
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def n_tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False).input_ids)

    right = 0
    with httpx.Client(base_url=served.url, timeout=60) as client:
        for s in samples:
            pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
            ours = []
            for context, choice in pairs:
                body = {"model": MODEL, "prompt": context + choice, "echo": True, "logprobs": 1, "max_tokens": 1,
                        "temperature": 0}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"][:-1]  # the prompt's
                ours.append(sum(logprobs[-(n_tokens(context + choice) - n_tokens(context)):]))
            theirs = [float(resp[0][0]) for resp in s["resps"]]
            assert ours == pytest.approx(theirs, abs=1e-3), (s["doc"], ours, theirs)
            right += max(range(len(ours)), key=ours.__getitem__) == s["doc"]["answer"]
    assert acc == pytest.approx(right / len(samples))
    print(f"lm_eval {MC}: acc {acc:.2f} over {len(samples)} questions")


@pytest.mark.slow
def test_lm_eval_generate_until_over_chat_completions_gets_the_servers_greedy_answers(served, tmp_path):
    before = request_counts(served.url)
    args = f"base_url={served.url}/v1/chat/completions,model={MODEL},num_concurrent=2,{ONE_ATTEMPT}"
    result, samples = _lm_eval("local-chat-completions", args, CHAT, tmp_path, "--apply_chat_template")
    assert new_requests(served.url, before) == {"ok": 10}
    em = result["exact_match,last_number"]
    assert isinstance(em, float) and 0 <= em <= 1

    # Our own scoring (the task's filter: the answer's last number) ...
    answers = [s["resps"][0][0] for s in samples]
    assert all(answers), answers
    right = sum(re.findall(r"-?\d+", a)[-1:] == [s["target"]] for a, s in zip(answers, samples))
    assert em == pytest.approx(right / len(samples))
    print(f"lm_eval {CHAT}: exact_match {em:.2f} over {len(samples)} questions")
    # ... and the answers are the server's: the request lm_eval sent, again, one at a time.
    with httpx.Client(base_url=served.url, timeout=60) as client:
        for answer, s in zip(answers, samples):
            messages = json.loads(s["arguments"]["gen_args_0"]["arg_0"][0])
            body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "stop": ["\n"],
                    "seed": 1234}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == answer


def test_lm_evals_remote_tokenizer_reads_the_servers_own(served, tokenizer_dir):
    """lm-eval's RemoteTokenizer (its tokenizer_backend=auto picks it when /tokenizer_info answers):
    /tokenizer_info, /tokenize and /detokenize give what the model's own tokenizer gives, so a
    client needs no tokenizer files of its own."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support
    from transformers import AutoTokenizer

    base = f"{served.url}/v1/completions"
    assert check_remote_tokenizer_support(base, max_retries=1)
    remote, local = RemoteTokenizer(base, max_retries=1), AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "The capital of France is Paris. Ünïcödé and\ttabs, 12345."
    ids = local.encode(text, add_special_tokens=False)
    assert remote.encode(text) == ids and remote.decode(ids) == text
    assert (remote.eos_token, remote.bos_token) == (local.eos_token, local.bos_token) and remote.eos_token
    assert remote.eos_token_id == local.eos_token_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert remote.apply_chat_template(messages) == local.apply_chat_template(messages, tokenize=False,
                                                                              add_generation_prompt=True)
    info = httpx.get(f"{served.url}/tokenizer_info", timeout=10).json()
    assert info["model"] == MODEL and info["vocab_size"] == len(local) and info["model_max_length"] > 0
    unknown = httpx.get(f"{served.url}/tokenizer_info", params={"model": "nope"}, timeout=10)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "model"  # as /tokenize's
