//! `tenantgate top --service URL`: the central service's bounded top-K
//! keys by demand and by denials, per region, with sync health, from its
//! admin listener's `GET /v1/top?k=N` (see `tenantgate_central::service::top`
//! for the sketch and its bounds). A live terminal view refreshing every
//! `--interval-ms` (quit with `q`, Esc or Ctrl-C), or one fetch printed with
//! `--once` (`--json`: the endpoint's JSON as it is).
//!
//! Keys of nested levels' budgets (`<action>|l|<level>|<len>:<value>|…`,
//! see `tenantgate::policy::levels::write_key`) are also shown **by
//! level**: per level, each budget's path (`acme/search`), its demand and
//! its denials, a guaranteed share as `acme/search (guaranteed)`. Only
//! global limits reach the service, so only global levels appear.
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
        render_levels(&mut out, d, x);
    }
    out
}

/// A nested level's budget key, read back: its action, level and path.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LevelKey {
    action: String,
    level: String,
    /// The values from the root down, `/`-joined (`-`: missing; `#…`: a
    /// key too long for the table, hashed).
    path: String,
    /// The guaranteed share of this member, if the budget is one.
    guaranteed: Option<String>,
}

/// `<action>|l|<level>|<len>:<value>|…[|g|<len>:<member>]` or
/// `<action>|l|<level>|#<hex>`; `None` for any other key.
fn level_key(key: &str) -> Option<LevelKey> {
    let (action, rest) = key.split_once("|l|")?;
    let (level, mut rest) = rest.split_once('|')?;
    if let Some(hash) = rest.strip_prefix('#') {
        return Some(LevelKey {
            action: action.to_owned(),
            level: level.to_owned(),
            path: format!("#{hash}"),
            guaranteed: None,
        });
    }
    let mut values: Vec<&str> = Vec::new();
    let mut guaranteed = None;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("g|") {
            let (member, tail) = length_prefixed(after)?;
            guaranteed = Some(member.to_owned());
            rest = tail;
            continue;
        }
        if let Some(tail) = rest.strip_prefix('-') {
            values.push("-");
            rest = tail.strip_prefix('|').unwrap_or(tail);
            continue;
        }
        let (value, tail) = length_prefixed(rest)?;
        values.push(value);
        rest = tail;
    }
    (!values.is_empty()).then(|| LevelKey {
        action: action.to_owned(),
        level: level.to_owned(),
        path: values.join("/"),
        guaranteed,
    })
}

/// `<len>:<value>` then an optional `|`: the value and what follows.
fn length_prefixed(s: &str) -> Option<(&str, &str)> {
    let (len, rest) = s.split_once(':')?;
    let len: usize = len.parse().ok()?;
    let value = rest.get(..len)?;
    let tail = rest.get(len..)?;
    Some((value, tail.strip_prefix('|').unwrap_or(tail)))
}

/// One budget's row in the by-level view.
#[derive(Default)]
struct LevelRow {
    demand: Option<u64>,
    denials: Option<u64>,
}

/// The value under `key` in an insertion-ordered list, added (default)
/// if absent.
fn entry<T: Default>(list: &mut Vec<(String, T)>, key: String) -> &mut T {
    let i = match list.iter().position(|(k, _)| *k == key) {
        Some(i) => i,
        None => {
            list.push((key, T::default()));
            list.len() - 1
        }
    };
    &mut list[i].1
}

/// The region's level keys grouped by level (in the order their heaviest
/// budget comes by demand), each budget with its demand and denials (`-`:
/// not among the top keys of that list).
fn render_levels(out: &mut String, by_demand: &[Value], by_denials: &[Value]) {
    let mut levels: Vec<(String, Vec<(String, LevelRow)>)> = Vec::new();
    let mut add = |e: &Value, denials: bool| {
        let Some(k) = e["key"].as_str().and_then(level_key) else {
            return;
        };
        let count = e["count"].as_u64().unwrap_or(0);
        let name = format!("{} ({})", k.level, k.action);
        let budget = match &k.guaranteed {
            Some(member) => format!("{}/{member} (guaranteed)", k.path),
            None => k.path,
        };
        let row = entry(entry(&mut levels, name), budget);
        let slot = if denials {
            &mut row.denials
        } else {
            &mut row.demand
        };
        *slot = Some(slot.unwrap_or(0).saturating_add(count));
    };
    for e in by_demand {
        add(e, false);
    }
    for e in by_denials {
        add(e, true);
    }
    if levels.is_empty() {
        return;
    }
    out.push_str(&format!(
        "  {:<56} {:>10} {:>10}\n",
        "by level", "demand", "denials"
    ));
    let show = |v: Option<u64>| v.map_or_else(|| String::from("-"), |n| n.to_string());
    for (name, rows) in levels {
        out.push_str(&format!("  {name}\n"));
        for (budget, row) in rows {
            out.push_str(&format!(
                "    {budget:<54} {:>10} {:>10}\n",
                show(row.demand),
                show(row.denials)
            ));
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_keys_are_read_back_and_other_keys_are_not() {
        let k = level_key("chat|l|team|4:acme|6:search").unwrap();
        assert_eq!(
            (k.action.as_str(), k.level.as_str(), k.path.as_str()),
            ("chat", "team", "acme/search")
        );
        assert_eq!(k.guaranteed, None);
        let g = level_key("chat|l|org|4:acme|g|6:search").unwrap();
        assert_eq!(
            (g.path.as_str(), g.guaranteed.as_deref()),
            ("acme", Some("search"))
        );
        // A value may hold `|` and `:`: its length says where it ends.
        let odd = level_key("chat|l|team|3:a|b|4:c:d|").unwrap();
        assert_eq!(odd.path, "a|b/c:d|");
        assert_eq!(level_key("chat|l|team|-|3:ads").unwrap().path, "-/ads");
        assert_eq!(level_key("chat|l|org|#00ff").unwrap().path, "#00ff");
        for other in [
            "chat|t|acme",
            "chat|l|org|9:short",
            "chat|l|org|x:y",
            "chat|l|org|",
        ] {
            assert_eq!(level_key(other), None, "{other}");
        }
    }

    #[test]
    fn the_view_groups_level_budgets_by_level() {
        let v = serde_json::json!({
            "policy_version": "nested-1", "half_life_s": 60, "sync_requests": {"ok": 3},
            "regions": [{"region": "eu", "reports": 3, "last_sync_ms_ago": 10,
                "by_demand": [
                    {"key": "chat|l|org|4:acme", "count": 900, "error": 0},
                    {"key": "chat|t|carol", "count": 500, "error": 0},
                    {"key": "chat|l|team|4:acme|3:ads", "count": 700, "error": 0},
                    {"key": "chat|l|org|4:acme|g|6:search", "count": 200, "error": 0},
                    {"key": "chat|l|team|4:acme|6:search", "count": 200, "error": 0}],
                "by_denials": [{"key": "chat|l|team|4:acme|3:ads", "count": 300, "error": 0}]}]
        });
        let text = render(&v);
        println!("{text}");
        let view: Vec<&str> = text.lines().skip_while(|l| !l.contains("by level")).collect();
        let row = |needle: &str| {
            view.iter()
                .find(|l| l.trim_start().starts_with(needle))
                .map(|l| l.split_whitespace().rev().take(2).collect::<Vec<_>>())
        };
        assert_eq!(view.get(1).map(|l| l.trim()), Some("org (chat)"));
        assert_eq!(row("acme "), Some(vec!["-", "900"]));
        assert_eq!(row("acme/search (guaranteed)"), Some(vec!["-", "200"]));
        assert_eq!(row("acme/ads"), Some(vec!["300", "700"]));
        assert!(view.iter().any(|l| l.trim() == "team (chat)"));
        assert!(
            !view.iter().any(|l| l.contains("carol")),
            "tenants are not levels"
        );
    }
}
