"""OpenAI bodies -> proto requests: unset fields stay unset, so the engine's defaults apply."""

from __future__ import annotations

from router.openai_protocol import ChatRequest, CompletionRequest, chat_call, completion_call


def test_unset_fields_stay_unset() -> None:
    completion = completion_call(CompletionRequest.model_validate({"prompt": "hi"})).request
    assert completion.sampling.max_tokens == 16  # OpenAI's completions default
    chat = chat_call(ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})).request
    assert chat.sampling.max_tokens == 0  # chat has no OpenAI default: until the context ends
    for request in (completion, chat):
        for name in ("temperature", "top_p", "seed", "logprobs", "speculative"):
            assert not request.sampling.HasField(name), name


def test_fields_map_onto_the_proto() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {"messages": [{"role": "developer", "content": parts}, {"role": "user", "content": "hi"}],
            "model": "m", "max_completion_tokens": 5, "max_tokens": 9, "temperature": 0, "top_p": 0.5, "seed": 7,
            "stop": "\n", "logprobs": True, "top_logprobs": 3, "top_k": -1, "ignore_eos": True,
            "stop_token_ids": [2], "user": "u", "stream": True, "stream_options": {"include_usage": True},
            "speculative": False}
    call = chat_call(ChatRequest.model_validate(body))
    s = call.request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop), s.logprobs, s.top_k, s.ignore_eos,
            list(s.stop_token_ids)) == (5, 0.0, 0.5, 7, ["\n"], 3, 0, True, [2])
    assert s.HasField("speculative") and s.speculative is False  # set, so the worker's default does not apply
    assert [(m.role, m.content) for m in call.request.messages.messages] == [("system", "a\nb"), ("user", "hi")]
    assert call.request.model == "m" and call.stream and call.include_usage
    assert call.param("sampling.max_tokens") == "max_completion_tokens"
    assert call.param("sampling.logprobs") == "top_logprobs"
    assert call.param("prompt") == "messages"

    completion = completion_call(CompletionRequest.model_validate({"prompt": [[1, 2, 3]], "logprobs": 0}))
    assert list(completion.request.token_ids.ids) == [1, 2, 3] and completion.request.sampling.logprobs == 0
    assert completion.param("prompt_token_ids") == "prompt"
