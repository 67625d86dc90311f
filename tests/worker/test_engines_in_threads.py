"""Two engines of different models stepping at once in one process (the cascade's two tiers in
one `serve`): each step must see its own attention metadata and KV pool, never the other's."""

from __future__ import annotations

import threading

from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_two_engines_step_concurrently_in_threads_and_match_running_alone(make_engine, prompt_ids):
    small = make_engine()  # SmolLM2: 3 KV heads of 64
    tiny = LLMEngine(EngineConfig(model="dummy:tiny"), tokenizer=None)  # 2 KV heads of 16
    tiny_prompts = [[(t * 7 + i) % 512 for t in range(5 + 3 * i)] for i in range(6)]
    alone_small = small.generate(prompt_ids[:6], GREEDY)
    alone_tiny = tiny.generate(tiny_prompts, GREEDY)

    results: dict[str, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(name, engine, prompts):
        try:
            start.wait()
            results[name] = [engine.generate(prompts, GREEDY) for _ in range(3)]
        except BaseException as exc:  # reported below, with the other thread's result
            errors.append(exc)

    threads = [threading.Thread(target=run, args=("small", small, prompt_ids[:6])),
               threading.Thread(target=run, args=("tiny", tiny, tiny_prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert results["small"] == [alone_small] * 3
    assert results["tiny"] == [alone_tiny] * 3
    small.check_integrity()
    tiny.check_integrity()
