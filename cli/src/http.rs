//! A minimal blocking HTTP/1.1 client (one request per connection) for
//! `tenantgate quota` and the CLI's tests.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// The most an answer may hold (head and body): a service that sends more
/// is refused, not read into memory.
pub const MAX_ANSWER_BYTES: u64 = 16 * 1024 * 1024;

/// Sends one request; returns the status and the body (an answer over
/// [`MAX_ANSWER_BYTES`] is an error).
pub fn request(
    addr: SocketAddr,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| format!("{addr}: {e}"))?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let auth = token
        .map(|t| format!("authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n{auth}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(|e| format!("{addr}: {e}"))?;
    let mut out = Vec::new();
    s.take(MAX_ANSWER_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("{addr}: {e}"))?;
    if out.len() as u64 > MAX_ANSWER_BYTES {
        return Err(format!(
            "{addr}: the answer is larger than {MAX_ANSWER_BYTES} bytes"
        ));
    }
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("malformed answer")?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("malformed answer")?;
    Ok((status, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Serves one connection with `answer`, after reading the request head.
    fn serve_once(answer: Vec<u8>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(&answer);
        });
        addr
    }

    #[test]
    fn an_answer_is_read_up_to_its_cap_and_no_further() {
        let small = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec();
        assert_eq!(
            request(serve_once(small), None, "GET", "/", "").unwrap(),
            (200, "ok".to_owned())
        );
        let mut huge = b"HTTP/1.1 200 OK\r\n\r\n".to_vec();
        huge.resize(MAX_ANSWER_BYTES as usize + 1, b'x');
        let err = request(serve_once(huge), None, "GET", "/", "").unwrap_err();
        assert!(err.contains("larger than"), "{err}");
    }
}
