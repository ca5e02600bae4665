"""Request handling (``serving/handlers.py``): the context-length check and the body-size limit."""

from __future__ import annotations

import json

from tests.serving.helpers import CHAT, COMPLETIONS, CONTEXT, NAME, SPEC, chat_ids, error_of, post


def test_prompt_longer_than_context_names_the_numbers(http, tokenizer):
    prompt = "hello " * 400
    n = len(tokenizer.encode(prompt))
    err = error_of(post(http, COMPLETIONS, {"model": NAME, "prompt": prompt, "max_tokens": 8}), 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert f"{CONTEXT} tokens" in err["message"] and f"prompt has {n} tokens" in err["message"]
    chat_n = len(chat_ids(tokenizer, prompt))
    err = error_of(post(http, CHAT, {"model": NAME, "messages": [{"role": "user", "content": prompt}]}), 400)
    assert err["param"] == "messages" and f"prompt has {chat_n} tokens" in err["message"]
    # a prompt that fits, with a budget that does not: both numbers and the total
    ids = tokenizer.encode("hello " * 200)
    err = error_of(post(http, COMPLETIONS, {"model": NAME, "prompt": "hello " * 200, "max_tokens": 100}), 400)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    total = len(ids) + 100 + SPEC.num_draft_tokens
    assert f"but {total} were requested ({len(ids)} in the prompt, 100 for the completion" in err["message"]


def test_oversized_body_is_413(http):
    big = {"model": NAME, "prompt": "x" * (64 * 1024)}
    error_of(post(http, COMPLETIONS, big), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]
    error_of(http.post(COMPLETIONS, content=chunked()), 413)
    assert http.get("/health").status_code == 200
