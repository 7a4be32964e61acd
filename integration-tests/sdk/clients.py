"""The model providers' own Python clients (the `openai` and `anthropic`
SDKs, `make setup-sdks`) calling Envoy, for integration-tests/tests/settle.rs.

    python clients.py PORT CASE TENANT [CLASS]

prints one JSON object: what the SDK reported (usage, status, time).
"""

import json
import sys
import time

import anthropic
import openai

port, case, tenant = sys.argv[1], sys.argv[2], sys.argv[3]
route_class = sys.argv[4] if len(sys.argv) > 4 else "chat"
base = f"http://127.0.0.1:{port}"
headers = {"x-tenant-id": tenant}
messages = [{"role": "user", "content": "Say hello."}]


# Every answer the SDK's HTTP client got: (seconds since start, status,
# retry-after).
started = time.monotonic()
answers = []


def seen(response):
    answers.append([time.monotonic() - started, response.status_code, response.headers.get("retry-after")])


def openai_client(answer, retries=0):
    # The test upstream answers by path; the SDK appends /chat/completions.
    return openai.OpenAI(
        base_url=f"{base}/up/{route_class}/model/{answer}/v1",
        api_key="test",
        default_headers=headers,
        max_retries=retries,
        timeout=30,
        http_client=openai.DefaultHttpxClient(event_hooks={"response": [seen]}),
    )


def read_openai_stream(stream):
    """The text and the usage (None if no chunk carried it) of a stream."""
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage.total_tokens
    return {"usage": usage, "content": text}


out = {}
if case == "openai_json":
    r = openai_client("json/1200").chat.completions.create(model="m", messages=messages, max_tokens=2000)
    out = {"usage": r.usage.total_tokens, "content": r.choices[0].message.content}
elif case == "openai_stream":
    stream = openai_client("sse/1200/0").chat.completions.create(
        model="m", messages=messages, max_tokens=2000, stream=True, stream_options={"include_usage": True}
    )
    out = read_openai_stream(stream)
elif case == "openai_stream_plain":
    # Streamed as most applications do: without stream_options (the
    # upstream, like OpenAI, then sends no usage unless the filter asks).
    stream = openai_client("openai/1200/0").chat.completions.create(
        model="m", messages=messages, max_tokens=2000, stream=True
    )
    out = read_openai_stream(stream)
elif case == "openai_json_plain":
    # Not streamed: the upstream, like OpenAI, refuses stream_options here.
    r = openai_client("openai/1200/0").chat.completions.create(model="m", messages=messages, max_tokens=2000)
    out = {"usage": r.usage.total_tokens, "content": r.choices[0].message.content}
elif case == "anthropic_stream":
    c = anthropic.Anthropic(
        base_url=f"{base}/up/messages/model/anthropic/300/0",
        api_key="test",
        default_headers=headers,
        max_retries=0,
        timeout=30,
    )
    stream = c.messages.create(model="m", max_tokens=2000, messages=messages, stream=True)
    input_tokens, output_tokens, text = 0, 0, ""
    for event in stream:
        if event.type == "message_start":
            input_tokens = event.message.usage.input_tokens
        elif event.type == "content_block_delta":
            text += event.delta.text
        elif event.type == "message_delta":
            output_tokens = event.usage.output_tokens
    out = {"usage": input_tokens + output_tokens, "content": text}
elif case == "openai_retry":
    try:
        r = openai_client("json/500", retries=2).chat.completions.create(model="m", messages=messages)
        out = {"status": 200, "usage": r.usage.total_tokens}
    except openai.RateLimitError as e:
        out = {"status": 429, "retry_after": e.response.headers.get("retry-after")}
    out["answers"] = answers
else:
    raise SystemExit(f"unknown case {case}")
print(json.dumps(out))
