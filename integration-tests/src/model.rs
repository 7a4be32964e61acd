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
    out.write_all(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes())?;
    out.flush()
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

/// Writes `answer` on `out` (`extra`: more header lines, each ending in
/// CRLF; `gzip`: the request accepts gzip, and a JSON answer is sent
/// compressed, as common servers do). `Ok(false)`: the connection was
/// closed on purpose (a reset).
pub fn answer(out: &mut TcpStream, answer: ModelAnswer, extra: &str, gzip: bool) -> std::io::Result<bool> {
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
        ModelAnswer::Sse { tokens, gap_ms } => {
            out.write_all(sse_head(extra).as_bytes())?;
            for delta in ["Hel", "lo", "!"] {
                chunk(out, &event(delta))?;
                std::thread::sleep(Duration::from_millis(gap_ms));
            }
            let last = format!(
                "data: {{\"id\":\"chatcmpl-test\",\"choices\":[],\"usage\":{}}}\n\n",
                usage(tokens)
            );
            chunk(out, &last)?;
            chunk(out, "data: [DONE]\n\n")?;
            out.write_all(b"0\r\n\r\n")?;
        }
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
            ModelAnswer::Tokens(3000),
        ] {
            assert_eq!(ModelAnswer::of_path(&format!("/up/chat{}", a.path())), Some(a));
        }
        assert_eq!(ModelAnswer::of_path("/up/chat"), None);
    }
}
