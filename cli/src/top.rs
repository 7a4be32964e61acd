//! `tenantgate top --service URL`: the central service's bounded top-K
//! keys by demand and by denials, per region, with sync health, from its
//! admin listener's `GET /v1/top?k=N` (see `tenantgate_central::service::top`
//! for the sketch and its bounds). A live terminal view refreshing every
//! `--interval-ms` (quit with `q`, Esc or Ctrl-C), or one fetch printed with
//! `--once` (`--json`: the endpoint's JSON as it is).
//!
//! The admin listener is plain HTTP on a private address.

use std::io::Write;
use std::net::ToSocketAddrs;
use std::time::Duration;

use serde_json::Value;

/// `http://HOST:PORT[/...]` → `HOST:PORT`.
fn authority(url: &str) -> Result<&str, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url}: expected http://HOST:PORT (the service's --admin address)"))?;
    Ok(rest.split('/').next().unwrap_or(rest))
}

/// Fetches `/v1/top?k=K` from the service at `url` (the CLI's one HTTP
/// client, `crate::http`).
pub fn fetch(url: &str, k: usize) -> Result<Value, String> {
    let host = authority(url)?;
    let addr = host
        .to_socket_addrs()
        .map_err(|e| format!("{host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host}: no address"))?;
    let (status, body) = crate::http::request(addr, None, "GET", &format!("/v1/top?k={k}"), "")?;
    if status != 200 {
        return Err(format!("{host}: /v1/top answered {status}: {}", body.trim()));
    }
    serde_json::from_str(&body).map_err(|e| format!("{host}: /v1/top: {e}"))
}

/// The view, as lines of text.
pub fn render(v: &Value) -> String {
    let mut out = String::new();
    let n = |x: &Value| x.as_u64().unwrap_or(0);
    let by_result = v["sync_requests"].as_object();
    let ok = by_result.map_or(0, |m| m.get("ok").map_or(0, n));
    let failed: u64 = by_result.map_or(0, |m| {
        m.iter()
            .filter(|(k, _)| k.as_str() != "ok")
            .map(|(_, x)| n(x))
            .sum()
    });
    out.push_str(&format!(
        "tenantgate top — policy {}  sync requests: {ok} ok, {failed} refused/failed  (decayed counts, half-life {} s; q quits)\n",
        v["policy_version"].as_str().unwrap_or("none"),
        n(&v["half_life_s"])
    ));
    let empty = Vec::new();
    let regions = v["regions"].as_array().unwrap_or(&empty);
    if regions.is_empty() {
        out.push_str("\nno sync reports yet\n");
    }
    for r in regions {
        out.push_str(&format!(
            "\nregion {}  ({} syncs, last {} ms ago)\n",
            r["region"].as_str().unwrap_or("?"),
            n(&r["reports"]),
            n(&r["last_sync_ms_ago"])
        ));
        out.push_str(&format!(
            "  {:<44} {:>10}   {:<44} {:>10}\n",
            "by demand", "units", "by denials", "units"
        ));
        let d = r["by_demand"].as_array().unwrap_or(&empty);
        let x = r["by_denials"].as_array().unwrap_or(&empty);
        for i in 0..d.len().max(x.len()) {
            let cell = |list: &Vec<Value>| match list.get(i) {
                Some(e) => (
                    e["key"].as_str().unwrap_or("").to_owned(),
                    format!("{}", n(&e["count"])),
                ),
                None => (String::new(), String::new()),
            };
            let ((dk, dc), (xk, xc)) = (cell(d), cell(x));
            out.push_str(&format!("  {dk:<44} {dc:>10}   {xk:<44} {xc:>10}\n"));
        }
    }
    out
}

/// The live view: redraws every `interval` until `q`, Esc or Ctrl-C.
pub fn live(url: &str, k: usize, interval: Duration) -> Result<(), String> {
    use crossterm::event::{self, Event, KeyCode, KeyModifiers};
    use crossterm::{cursor, execute, terminal};
    let mut stdout = std::io::stdout();
    terminal::enable_raw_mode().map_err(|e| e.to_string())?;
    let _ = execute!(stdout, terminal::EnterAlternateScreen, cursor::Hide);
    let result = (|| -> Result<(), String> {
        loop {
            let text = match fetch(url, k) {
                Ok(v) => render(&v),
                Err(e) => format!("tenantgate top: {e} (retrying; q quits)\n"),
            };
            let _ = execute!(
                stdout,
                cursor::MoveTo(0, 0),
                terminal::Clear(terminal::ClearType::All)
            );
            // Raw mode: lines need a carriage return.
            let _ = write!(stdout, "{}", text.replace('\n', "\r\n"));
            let _ = stdout.flush();
            if event::poll(interval).map_err(|e| e.to_string())? {
                if let Event::Key(key) = event::read().map_err(|e| e.to_string())? {
                    let ctrl_c =
                        key.code == KeyCode::Char('c') && key.modifiers.contains(KeyModifiers::CONTROL);
                    if matches!(key.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                        return Ok(());
                    }
                }
            }
        }
    })();
    let _ = execute!(stdout, cursor::Show, terminal::LeaveAlternateScreen);
    let _ = terminal::disable_raw_mode();
    result
}
