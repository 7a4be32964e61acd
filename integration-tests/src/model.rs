//! The test upstream answering like a model API (for costs settled after
//! the response, `crate::upstream`): a request whose path has a
//! `/model/<answer>` part gets that answer, chosen by the test through
//! the path (the upstream's own decision: the filter never reads the
//! path for a cost).
//!
//! | path part | answer |
//! |---|---|
//! | `/model/json/<n>` | 200 `application/json`, OpenAI-style, `usage.total_tokens` = n (prompt 10 %, completion the rest) |
//! | `/model/sse/<n>/<ms>` | 200 `text/event-stream`, chunked: three content events, `<ms>` ms apart, then one with the usage (total n), then `data: [DONE]` |
//! | `/model/header/<n>` | 200 with `x-usage-tokens: n` and a short body |
//! | `/model/missing` | 200 JSON without `usage` |
//! | `/model/malformed` | 200 JSON whose `usage.total_tokens` is a string |
//! | `/model/reset/<ms>` | 200 `text/event-stream`: two content events, then after `<ms>` ms the connection is closed mid-body (no usage, no end) |
//! | `/model/gemini/<n>[/cut]` | 200 `application/json`, chunked: Gemini's `streamGenerateContent` JSON array, each element with the running `usageMetadata` (the last: total n); `cut`: closed after the second element |
//! | `/model/bedrock/<n>[/cut]` | 200 `application/vnd.amazon.eventstream`: Bedrock `ConverseStream`'s binary messages, the `metadata` event last with `usage.totalTokens` = n; `cut`: closed before `metadata` |
//! | `/model/tokens/<n>` | 200 `text/event-stream`, chunked: `n` one-token OpenAI content events, ten a chunk every millisecond, then the usage (`n` + 20) and `[DONE]`, whatever the request claimed |
//! | `/model/huge/<mb>` | 200 `text/event-stream`: `<mb>` MiB of content events, then a usage chunk claiming 1 token |
//! | `/model/openai/<n>/<ms>` | as OpenAI Chat Completions answers the request's JSON body: `"stream": true` gets `sse/<n>/<ms>`'s events with the usage chunk only if `stream_options.include_usage` is `true`; otherwise `json/<n>`; `stream_options` without `"stream": true` gets 400 (OpenAI's "only allowed when stream is enabled") |

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

/// One of the answers above, parsed from a request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelAnswer {
    Json(u64),
    Sse {
        tokens: u64,
        gap_ms: u64,
    },
    Header(u64),
    Missing,
    Malformed,
    Reset {
        after_ms: u64,
    },
    /// An Anthropic Messages stream: `message_start` (25 input tokens, 1
    /// output), content deltas, then after `gap_ms` the cumulative
    /// `message_delta` (`output` tokens) and `message_stop`, and after
    /// `gap_ms` more the response's end.
    Anthropic {
        output: u64,
        gap_ms: u64,
    },
    Gemini {
        tokens: u64,
        cut: bool,
    },
    Bedrock {
        tokens: u64,
        cut: bool,
    },
    Huge {
        mb: u64,
    },
    /// As OpenAI answers the request body (see the module header).
    OpenAi {
        tokens: u64,
        gap_ms: u64,
    },
    /// An OpenAI chat stream of `tokens` one-token delta events, 10 an
    /// event chunk every millisecond, then its usage (`tokens` + 20 input)
    /// and `[DONE]`: what an upstream streams for a request whatever its
    /// `max_tokens` claimed.
    Tokens(u64),
}

impl ModelAnswer {
    /// The answer a path asks for (`None`: not a model path).
    pub fn of_path(path: &str) -> Option<ModelAnswer> {
        let path = path.split('?').next().unwrap_or_default();
        let rest = path.split("/model/").nth(1)?;
        let mut parts = rest.split('/');
        let kind = parts.next()?;
        let mut num = || parts.next().and_then(|n| n.parse::<u64>().ok());
        Some(match kind {
            "json" => ModelAnswer::Json(num()?),
            "sse" => ModelAnswer::Sse {
                tokens: num()?,
                gap_ms: num().unwrap_or(0),
            },
            "header" => ModelAnswer::Header(num()?),
            "missing" => ModelAnswer::Missing,
            "malformed" => ModelAnswer::Malformed,
            "reset" => ModelAnswer::Reset {
                after_ms: num().unwrap_or(0),
            },
            "tokens" => ModelAnswer::Tokens(num()?),
            "anthropic" => ModelAnswer::Anthropic {
                output: num()?,
                gap_ms: num().unwrap_or(0),
            },
            "gemini" | "bedrock" => {
                let tokens = num()?;
                let cut = parts.next() == Some("cut");
                if kind == "gemini" {
                    ModelAnswer::Gemini { tokens, cut }
                } else {
                    ModelAnswer::Bedrock { tokens, cut }
                }
            }
            "huge" => ModelAnswer::Huge { mb: num()? },
            "openai" => ModelAnswer::OpenAi {
                tokens: num()?,
                gap_ms: num().unwrap_or(0),
            },
            _ => return None,
        })
    }

    /// The `path` suffix that asks for this answer.
    pub fn path(&self) -> String {
        match self {
            ModelAnswer::Json(n) => format!("/model/json/{n}"),
            ModelAnswer::Sse { tokens, gap_ms } => format!("/model/sse/{tokens}/{gap_ms}"),
            ModelAnswer::Header(n) => format!("/model/header/{n}"),
            ModelAnswer::Missing => "/model/missing".into(),
            ModelAnswer::Malformed => "/model/malformed".into(),
            ModelAnswer::Reset { after_ms } => format!("/model/reset/{after_ms}"),
            ModelAnswer::Anthropic { output, gap_ms } => format!("/model/anthropic/{output}/{gap_ms}"),
            ModelAnswer::OpenAi { tokens, gap_ms } => format!("/model/openai/{tokens}/{gap_ms}"),
            ModelAnswer::Gemini { tokens, cut } => {
                format!("/model/gemini/{tokens}{}", if *cut { "/cut" } else { "" })
            }
            ModelAnswer::Bedrock { tokens, cut } => {
                format!("/model/bedrock/{tokens}{}", if *cut { "/cut" } else { "" })
            }
            ModelAnswer::Huge { mb } => format!("/model/huge/{mb}"),
            ModelAnswer::Tokens(n) => format!("/model/tokens/{n}"),
        }
    }
}

fn usage(total: u64) -> String {
    let prompt = total / 10;
    format!(
        r#"{{"prompt_tokens":{prompt},"completion_tokens":{},"total_tokens":{total}}}"#,
        total - prompt
    )
}

fn completion(usage: Option<&str>) -> String {
    let usage = usage.map(|u| format!(r#","usage":{u}"#)).unwrap_or_default();
    format!(
        r#"{{"id":"chatcmpl-test","object":"chat.completion","model":"test","choices":[{{"index":0,"message":{{"role":"assistant","content":"Hello from the model, \"usage\": {{\"total_tokens\": 1}}"}},"finish_reason":"stop"}}]{usage}}}"#
    )
}

fn chunk(out: &mut TcpStream, data: &str) -> std::io::Result<()> {
    chunk_bytes(out, data.as_bytes())
}

fn sse_head(extra: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n{extra}transfer-encoding: chunked\r\n\r\n"
    )
}

fn event(delta: &str) -> String {
    format!(
        "data: {{\"id\":\"chatcmpl-test\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{delta}\"}}}}],\"usage\":null}}\n\n"
    )
}

/// A body gzip-compressed, as an upstream honouring `accept-encoding`
/// sends it.
fn gzipped(body: &str) -> Vec<u8> {
    use flate2::write::GzEncoder;
    let mut e = GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(body.as_bytes()).unwrap();
    e.finish().unwrap()
}

/// A streamed OpenAI answer of `tokens` (the usage chunk only if asked for).
fn openai_stream(
    out: &mut TcpStream,
    extra: &str,
    tokens: u64,
    gap_ms: u64,
    with_usage: bool,
) -> std::io::Result<()> {
    out.write_all(sse_head(extra).as_bytes())?;
    for delta in ["Hel", "lo", "!"] {
        chunk(out, &event(delta))?;
        std::thread::sleep(Duration::from_millis(gap_ms));
    }
    if with_usage {
        let last = format!(
            "data: {{\"id\":\"chatcmpl-test\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{}}}\n\n",
            usage(tokens)
        );
        chunk(out, &last)?;
    }
    chunk(out, "data: [DONE]\n\n")?;
    out.write_all(b"0\r\n\r\n")
}

/// One AWS event stream message (`:event-type` `kind`, a JSON payload),
/// its two CRC-32 checksums as AWS computes them.
fn aws_message(kind: &str, payload: &str) -> Vec<u8> {
    let mut headers = Vec::new();
    for (name, value) in [
        (":event-type", kind),
        (":content-type", "application/json"),
        (":message-type", "event"),
    ] {
        headers.push(name.len() as u8);
        headers.extend_from_slice(name.as_bytes());
        headers.push(7);
        headers.extend_from_slice(&(value.len() as u16).to_be_bytes());
        headers.extend_from_slice(value.as_bytes());
    }
    let total = (12 + headers.len() + payload.len() + 4) as u32;
    let crc = |bytes: &[u8]| {
        let mut c = flate2::Crc::new();
        c.update(bytes);
        c.sum()
    };
    let mut m = Vec::new();
    m.extend_from_slice(&total.to_be_bytes());
    m.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    let prelude = crc(&m);
    m.extend_from_slice(&prelude.to_be_bytes());
    m.extend_from_slice(&headers);
    m.extend_from_slice(payload.as_bytes());
    let whole = crc(&m);
    m.extend_from_slice(&whole.to_be_bytes());
    m
}

fn chunk_bytes(out: &mut TcpStream, data: &[u8]) -> std::io::Result<()> {
    out.write_all(format!("{:x}\r\n", data.len()).as_bytes())?;
    out.write_all(data)?;
    out.write_all(b"\r\n")?;
    out.flush()
}

fn chunked_head(content_type: &str, extra: &str) -> String {
    format!("HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\n{extra}transfer-encoding: chunked\r\n\r\n")
}

/// Writes `answer` on `out` for a request whose body was `request`
/// (`extra`: more header lines, each ending in CRLF; `gzip`: the request
/// accepts gzip, and a JSON answer is sent compressed, as common servers
/// do). `Ok(false)`: the connection was closed on purpose (a reset).
pub fn answer(
    out: &mut TcpStream,
    answer: ModelAnswer,
    extra: &str,
    gzip: bool,
    request: &[u8],
) -> std::io::Result<bool> {
    let json = |body: String, headers: &str| {
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{headers}{extra}content-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    match answer {
        ModelAnswer::Json(n) if gzip => {
            let body = gzipped(&completion(Some(&usage(n))));
            out.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n{extra}content-length: {}\r\n\r\n",
                    body.len()
                )
                .as_bytes(),
            )?;
            out.write_all(&body)?;
        }
        ModelAnswer::Json(n) => out.write_all(json(completion(Some(&usage(n))), "").as_bytes())?,
        ModelAnswer::Header(n) => {
            out.write_all(json(completion(None), &format!("x-usage-tokens: {n}\r\n")).as_bytes())?
        }
        ModelAnswer::Missing => out.write_all(json(completion(None), "").as_bytes())?,
        ModelAnswer::Malformed => {
            out.write_all(json(completion(Some(r#"{"total_tokens":"lots"}"#)), "").as_bytes())?
        }
        ModelAnswer::OpenAi { tokens, gap_ms } => {
            let body: serde_json::Value = serde_json::from_slice(request).unwrap_or_default();
            let stream = body["stream"] == serde_json::Value::Bool(true);
            let include_usage = body["stream_options"]["include_usage"] == serde_json::Value::Bool(true);
            if !stream && !body["stream_options"].is_null() {
                let error = r#"{"error":{"message":"The 'stream_options' parameter is only allowed when 'stream' is enabled.","type":"invalid_request_error","param":"stream_options","code":null}}"#;
                out.write_all(
                    format!(
                        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{error}",
                        error.len()
                    )
                    .as_bytes(),
                )?;
            } else if stream {
                openai_stream(out, extra, tokens, gap_ms, include_usage)?;
            } else {
                out.write_all(json(completion(Some(&usage(tokens))), "").as_bytes())?;
            }
        }
        ModelAnswer::Gemini { tokens, cut } => {
            out.write_all(chunked_head("application/json; charset=UTF-8", extra).as_bytes())?;
            let prompt = tokens / 10;
            let element = |text: &str, total: u64, last: bool| {
                let finish = if last { r#","finishReason":"STOP""# } else { "" };
                format!(
                    r#"{{"candidates":[{{"content":{{"parts":[{{"text":"{text}"}}],"role":"model"}}{finish},"index":0}}],"usageMetadata":{{"promptTokenCount":{prompt},"candidatesTokenCount":{},"totalTokenCount":{total}}},"modelVersion":"gemini-test"}}"#,
                    total - prompt
                )
            };
            chunk(out, &format!("[{}", element("Hel", prompt + 1, false)))?;
            chunk(out, &format!(",\r\n{}", element("lo", prompt + 2, false)))?;
            if cut {
                let _ = out.shutdown(std::net::Shutdown::Both);
                return Ok(false);
            }
            chunk(out, &format!(",\r\n{}]", element("!", tokens, true)))?;
            out.write_all(b"0\r\n\r\n")?;
        }
        ModelAnswer::Bedrock { tokens, cut } => {
            out.write_all(chunked_head("application/vnd.amazon.eventstream", extra).as_bytes())?;
            chunk_bytes(
                out,
                &aws_message("messageStart", r#"{"p":"abcd","role":"assistant"}"#),
            )?;
            for text in ["Hel", "lo", "!"] {
                let delta =
                    format!(r#"{{"contentBlockIndex":0,"delta":{{"text":"{text}"}},"p":"abcdefgh"}}"#);
                chunk_bytes(out, &aws_message("contentBlockDelta", &delta))?;
            }
            chunk_bytes(
                out,
                &aws_message("contentBlockStop", r#"{"contentBlockIndex":0,"p":"a"}"#),
            )?;
            chunk_bytes(
                out,
                &aws_message("messageStop", r#"{"p":"abc","stopReason":"end_turn"}"#),
            )?;
            if cut {
                let _ = out.shutdown(std::net::Shutdown::Both);
                return Ok(false);
            }
            let input = tokens / 10;
            let metadata = format!(
                r#"{{"metrics":{{"latencyMs":412}},"p":"ab","usage":{{"inputTokens":{input},"outputTokens":{},"totalTokens":{tokens}}}}}"#,
                tokens - input
            );
            chunk_bytes(out, &aws_message("metadata", &metadata))?;
            out.write_all(b"0\r\n\r\n")?;
        }
        ModelAnswer::Huge { mb } => {
            out.write_all(sse_head(extra).as_bytes())?;
            let one = event(&"x".repeat(900));
            let block = one.repeat((64 * 1024) / one.len());
            let mut sent = 0u64;
            while sent < mb * 1024 * 1024 {
                chunk(out, &block)?;
                sent += block.len() as u64;
            }
            chunk(
                out,
                "data: {\"id\":\"chatcmpl-test\",\"choices\":[],\"usage\":{\"prompt_tokens\":0,\"completion_tokens\":1,\"total_tokens\":1}}\n\ndata: [DONE]\n\n",
            )?;
            out.write_all(b"0\r\n\r\n")?;
        }
        ModelAnswer::Sse { tokens, gap_ms } => openai_stream(out, extra, tokens, gap_ms, true)?,
        ModelAnswer::Reset { after_ms } => {
            out.write_all(sse_head(extra).as_bytes())?;
            for delta in ["Hel", "lo"] {
                chunk(out, &event(delta))?;
            }
            std::thread::sleep(Duration::from_millis(after_ms));
            // Mid-body: closed without the usage or the last chunk.
            let _ = out.shutdown(std::net::Shutdown::Both);
            return Ok(false);
        }
        ModelAnswer::Tokens(n) => {
            out.write_all(sse_head(extra).as_bytes())?;
            let mut sent = 0;
            while sent < n {
                let k = (n - sent).min(10);
                if chunk(out, &event("tok").repeat(k as usize)).is_err() {
                    // The client or the filter ended the stream.
                    return Ok(false);
                }
                sent += k;
                std::thread::sleep(Duration::from_millis(1));
            }
            let last = format!(
                "data: {{\"id\":\"chatcmpl-test\",\"choices\":[],\"usage\":{{\"prompt_tokens\":20,\"completion_tokens\":{n},\"total_tokens\":{}}}}}\n\n",
                n + 20
            );
            chunk(out, &last)?;
            chunk(out, "data: [DONE]\n\n")?;
            out.write_all(b"0\r\n\r\n")?;
        }
        ModelAnswer::Anthropic { output, gap_ms } => {
            out.write_all(sse_head(extra).as_bytes())?;
            let event = |name: &str, data: &str| format!("event: {name}\ndata: {data}\n\n");
            chunk(
                out,
                &event(
                    "message_start",
                    r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"usage":{"input_tokens":25,"output_tokens":1}}}"#,
                ),
            )?;
            for text in ["Hel", "lo", "!"] {
                let delta = format!(
                    r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":"{text}"}}}}"#
                );
                chunk(out, &event("content_block_delta", &delta))?;
            }
            chunk(
                out,
                &event("content_block_stop", r#"{"type":"content_block_stop","index":0}"#),
            )?;
            std::thread::sleep(Duration::from_millis(gap_ms));
            let delta = format!(
                r#"{{"type":"message_delta","delta":{{"stop_reason":"end_turn"}},"usage":{{"output_tokens":{output}}}}}"#
            );
            chunk(out, &event("message_delta", &delta))?;
            chunk(out, &event("message_stop", r#"{"type":"message_stop"}"#))?;
            // The response's end comes `gap_ms` after its terminal event.
            std::thread::sleep(Duration::from_millis(gap_ms));
            out.write_all(b"0\r\n\r\n")?;
        }
    }
    out.flush()?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_round_trip() {
        for a in [
            ModelAnswer::Json(1200),
            ModelAnswer::Sse { tokens: 9, gap_ms: 5 },
            ModelAnswer::Header(7),
            ModelAnswer::Missing,
            ModelAnswer::Malformed,
            ModelAnswer::Reset { after_ms: 20 },
            ModelAnswer::Anthropic {
                output: 300,
                gap_ms: 500,
            },
            ModelAnswer::Gemini {
                tokens: 11,
                cut: true,
            },
            ModelAnswer::Bedrock {
                tokens: 658,
                cut: false,
            },
            ModelAnswer::Huge { mb: 50 },
            ModelAnswer::OpenAi {
                tokens: 12,
                gap_ms: 3,
            },
            ModelAnswer::Tokens(3000),
        ] {
            assert_eq!(ModelAnswer::of_path(&format!("/up/chat{}", a.path())), Some(a));
        }
        assert_eq!(ModelAnswer::of_path("/up/chat"), None);
    }
}
