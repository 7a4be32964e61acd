//! Degraded responses (`routes.<class>.degradable`): a GET or HEAD request
//! that admission control refuses for a shedding reason is answered 200
//! from the last good response of the same tenant and path, if it is
//! fresh enough, instead of failing.
//!
//! # What is kept
//! The last **200** response to a GET of the class, per **cache key**: the
//! tenant (`t|<tenant>`; anonymous clients get and store nothing unless
//! `anonymous: true`, and then share one `a|` space: only for public
//! content) and the request's `:path` (path and query, byte-exact). No
//! other request header keys it: do not mark a route degradable whose
//! answer varies by other headers (`Accept-Language`, cookies). Kept: the
//! body (at most `max_body_bytes`), the headers [`KEPT_HEADERS`] and the
//! class's `version_header` (default `etag`), at most
//! [`MAX_KEPT_HEADERS_BYTES`], and the capture time. A bigger answer, or a
//! key over [`MAX_CACHE_KEY_LEN`], is not kept (counted:
//! `degraded.too_large`), nor one with `cache-control: no-store`. A worker stores a key's answer at most once per
//! `refresh` (each store writes the whole answer to shared data).
//!
//! # Where, and how much memory
//! Node-wide, in shared data: each class has `slots` fixed entries
//! `tg2|g|<class>|<n>`, one answer each. A cache key hashes (FNV-1a) to
//! one slot; the slot stores the full key, so a lookup whose key differs
//! is a miss (**an answer is never served for another key, so never to
//! another tenant**). A store overwrites whatever the slot held (counted
//! as an eviction when it was another key): two hot keys that collide
//! evict each other, and the one evicted is answered 503 while refused.
//! Memory per class is at most
//! `slots × (max_body_bytes + 4 KiB of headers + 2 KiB of key + 60 B +
//! Envoy's ≈ 130 B per key)`: with the defaults (64 slots, 16 KiB)
//! 1.4 MiB; at the limits (4,096 slots, 48 KiB) 217 MiB. Shared data has
//! no delete: the entries stay, overwritten in place, for the life of the
//! Envoy process.
//!
//! # When it is served
//! Only for a refusal with a **shedding reason** ([`serves`]):
//! `concurrency_limit`, `queue_full`, `queue_timeout`, `circuit_open`,
//! `circuit_probe_limit`, `paused`, and `retry_budget` (the retry is not
//! sent; the client gets the last good answer instead). Never for request
//! checks (`request_too_large`, `timeout_budget`), `tenant_share` (a
//! tenant over its share is not shed but capped), `stream_limit`, or
//! shared-data failures; never in `mode: shadow`. Only for GET and HEAD
//! (HEAD: the headers, no body); **any other method gets its refusal**:
//! never a cached body, never dropped. The answer is the kept headers plus
//! `age` (whole seconds since capture), `x-tenantgate-captured-at` (the
//! capture time, an HTTP-date), `x-tenantgate-degraded: <reason>` and
//! `cache-control: no-store` (no downstream cache keeps a stale answer as
//! fresh). An answer older than `max_stale`, or none, makes the refusal
//! 503 `dependency_unavailable` with the refusal's `Retry-After`.
//!
//! Pure: time is `now`, the host is [`Host`].

use std::borrow::Cow;

use crate::decision::{Reason, Subject};
use crate::host::Host;
use crate::keys::kind;
use crate::limiter::NANOS_PER_SEC;
use crate::policy::admission::Degradable;
use crate::response::LocalReply;
use crate::table::{self, fnv1a64, layout::Reader, push_record_with, Commit, Failure, Place, Reach, Records};

const FORMAT: u8 = 1;
/// Response headers kept besides the class's `version_header`.
pub const KEPT_HEADERS: [&str; 4] = [
    "content-type",
    "content-encoding",
    "content-language",
    "last-modified",
];
/// Most bytes of kept header names and values together.
pub const MAX_KEPT_HEADERS_BYTES: usize = 4096;
/// Longest cache key (tenant + path and query).
pub const MAX_CACHE_KEY_LEN: usize = 2048;
/// The degraded marker header.
pub const DEGRADED_HEADER: &str = "x-tenantgate-degraded";
/// The capture time header.
pub const CAPTURED_AT_HEADER: &str = "x-tenantgate-captured-at";

/// Whether a refusal for `reason` may be answered from the cache (see the
/// module header).
pub fn serves(reason: Reason) -> bool {
    matches!(
        reason,
        Reason::ConcurrencyLimit
            | Reason::QueueFull
            | Reason::QueueTimeout
            | Reason::CircuitOpen
            | Reason::CircuitProbeLimit
            | Reason::Paused
            | Reason::RetryBudget
    )
}

/// Whether a method may be answered from (GET, HEAD) or captured into
/// (GET) the cache.
pub fn readable(method: &[u8]) -> bool {
    method == b"GET" || method == b"HEAD"
}

/// A request's cache key: its tenant and its path with query. `None`:
/// anonymous without `anonymous: true`, no subject, or a key over
/// [`MAX_CACHE_KEY_LEN`].
pub fn cache_key(deg: &Degradable, subject: &Subject, path: &[u8]) -> Option<Vec<u8>> {
    let mut key = Vec::with_capacity(path.len().saturating_add(32));
    match subject {
        Subject::Tenant(id) => {
            key.extend_from_slice(b"t|");
            key.extend_from_slice(id.as_bytes());
        }
        Subject::Anonymous { .. } if deg.anonymous => key.extend_from_slice(b"a|"),
        Subject::Anonymous { .. } | Subject::None => return None,
    }
    // A tenant id never holds a newline (header values cannot).
    key.push(b'\n');
    key.extend_from_slice(path);
    (key.len() <= MAX_CACHE_KEY_LEN).then_some(key)
}

/// The shared-data key of the slot a cache key lives in.
pub fn slot_key(deg: &Degradable, cache_key: &[u8]) -> String {
    let slot = fnv1a64(cache_key) % u64::from(deg.slots.max(1));
    crate::keys::degraded(&deg.class, slot)
}

/// The headers a class keeps, lower-cased: [`KEPT_HEADERS`] and its
/// version header.
pub fn kept_headers(deg: &Degradable) -> impl Iterator<Item = &str> {
    let extra = (!KEPT_HEADERS.contains(&deg.version_header.as_str())).then_some(deg.version_header.as_str());
    KEPT_HEADERS.into_iter().chain(extra)
}

/// A cached answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cached {
    pub key: Vec<u8>,
    pub captured_at: u64,
    /// Lower-cased names, in [`kept_headers`] order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// Why an answer was not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotStored {
    /// Body, headers or key over their bounds.
    TooLarge,
    /// Shared data failed, or another worker wrote the slot meanwhile.
    Failed,
}

/// A stored answer: whether it replaced another key's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    pub evicted: bool,
}

impl Cached {
    /// Whether it is within the bounds of `deg` (and so fits one record).
    pub fn fits(&self, deg: &Degradable) -> bool {
        let headers: usize = self
            .headers
            .iter()
            .map(|(n, v)| n.len().saturating_add(v.len()))
            .sum();
        self.body.len() <= deg.max_body_bytes as usize
            && headers <= MAX_KEPT_HEADERS_BYTES
            && self.key.len() <= MAX_CACHE_KEY_LEN
            && self.headers.len() <= usize::from(u8::MAX)
            && self
                .headers
                .iter()
                .all(|(n, v)| n.len() <= 255 && v.len() <= MAX_KEPT_HEADERS_BYTES)
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.push(1);
        push_record_with(out, 0, kind::DEGRADED, 0, 0, |o| {
            let len16 = |n: usize| u16::try_from(n).unwrap_or(u16::MAX).to_le_bytes();
            o.push(FORMAT);
            o.extend_from_slice(&self.captured_at.to_le_bytes());
            o.extend_from_slice(&len16(self.key.len()));
            o.extend_from_slice(&self.key);
            o.push(u8::try_from(self.headers.len()).unwrap_or(u8::MAX));
            for (name, value) in &self.headers {
                o.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
                o.extend_from_slice(name.as_bytes());
                o.extend_from_slice(&len16(value.len()));
                o.extend_from_slice(value.as_bytes());
            }
            o.extend_from_slice(&u32::try_from(self.body.len()).unwrap_or(u32::MAX).to_le_bytes());
            o.extend_from_slice(&self.body);
        });
    }

    fn decode(records: Option<&Records<'_>>) -> Option<Cached> {
        let state = records?.iter().find(|r| r.kind == kind::DEGRADED)?.state;
        let mut r = Reader(state);
        if r.u8()? != FORMAT {
            return None;
        }
        let captured_at = r.u64()?;
        let key_len = usize::from(r.u16()?);
        let key = r.take(key_len)?.to_vec();
        let n = r.u8()?;
        let mut headers = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            let name_len = usize::from(r.u8()?);
            let name = core::str::from_utf8(r.take(name_len)?).ok()?.to_owned();
            let value_len = usize::from(r.u16()?);
            let value = core::str::from_utf8(r.take(value_len)?).ok()?.to_owned();
            headers.push((name, value));
        }
        let body_len = usize::try_from(r.u32()?).ok()?;
        let body = r.take(body_len)?.to_vec();
        Some(Cached {
            key,
            captured_at,
            headers,
            body,
        })
    }
}

/// A slot is a fixed entry: never reclaimed, only overwritten.
const INSERT: Reach<'static> = Reach::Insert {
    is_idle: &|_, _| false,
};

/// Stores an answer in its key's slot (one best-effort compare-and-swap:
/// a conflict means another worker just stored one, which is as good).
pub fn store<H: Host>(
    host: &H,
    deg: &Degradable,
    answer: &Cached,
    buffers: &mut table::Buffers,
) -> Result<Stored, NotStored> {
    if !answer.fits(deg) {
        return Err(NotStored::TooLarge);
    }
    let key = slot_key(deg, &answer.key);
    let updated = table::update(
        host,
        &Place::Fixed { key: &key },
        &INSERT,
        answer.captured_at,
        buffers,
        |records, out| {
            let evicted = records
                .and_then(|rs| rs.iter().find(|r| r.kind == kind::DEGRADED).map(|r| r.state))
                .is_some_and(|state| {
                    let mut r = Reader(state);
                    let mut key_of = || -> Option<&[u8]> {
                        r.u8()?;
                        r.u64()?;
                        let n = usize::from(r.u16()?);
                        r.take(n)
                    };
                    key_of() != Some(answer.key.as_slice())
                });
            answer.encode(out);
            (Commit::BestEffort, evicted)
        },
    );
    match updated {
        Ok(u) if u.written => Ok(Stored { evicted: u.result }),
        Ok(_)
        | Err(Failure::Exhausted | Failure::Unavailable { .. } | Failure::Absent | Failure::TooLarge) => {
            Err(NotStored::Failed)
        }
    }
}

/// What the cache has for a refused request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// At most `max_stale` old: serve it.
    Fresh(Cached),
    /// Older than `max_stale` (its age in nanoseconds).
    Stale { age_ns: u64 },
    /// Nothing for this key (or shared data could not say).
    Miss,
}

/// Looks a cache key up at `now` (one shared-data read).
pub fn lookup<H: Host>(host: &H, deg: &Degradable, key: &[u8], now: u64) -> Lookup {
    let Ok((Some(value), _)) = host.shared_get(&slot_key(deg, key)) else {
        return Lookup::Miss;
    };
    let cached = table::decode_entry(&value)
        .and_then(|slots| slots.first().and_then(|s| table::decode_records(s.records)))
        .and_then(|records| Cached::decode(Some(&records)));
    match cached {
        Some(c) if c.key == key => {
            let age_ns = now.saturating_sub(c.captured_at);
            if age_ns <= deg.max_stale_ns {
                Lookup::Fresh(c)
            } else {
                Lookup::Stale { age_ns }
            }
        }
        _ => Lookup::Miss,
    }
}

/// The answer to a refused request from `cached` (see the module header);
/// `head`: headers only.
pub fn reply(cached: &Cached, reason: Reason, now: u64, head: bool) -> LocalReply {
    let age_secs = now.saturating_sub(cached.captured_at) / NANOS_PER_SEC;
    let mut headers: Vec<(Cow<'static, str>, String)> = cached
        .headers
        .iter()
        .map(|(n, v)| (Cow::Owned(n.clone()), v.clone()))
        .collect();
    headers.push(("age".into(), age_secs.to_string()));
    headers.push((
        CAPTURED_AT_HEADER.into(),
        http_date(cached.captured_at / NANOS_PER_SEC),
    ));
    headers.push((DEGRADED_HEADER.into(), reason.as_str().to_owned()));
    headers.push(("cache-control".into(), "no-store".to_owned()));
    LocalReply {
        status: 200,
        headers,
        body: if head { Vec::new() } else { cached.body.clone() },
    }
}

/// An IMF-fixdate (RFC 9110 §5.6.7) of Unix seconds.
pub fn http_date(unix_secs: u64) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let days = unix_secs / 86_400;
    let rem = unix_secs % 86_400;
    let (h, m, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Howard Hinnant's civil_from_days, for days ≥ 0.
    let z = days.saturating_add(719_468);
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = (yoe + era * 400).saturating_add(u64::from(month <= 2));
    let weekday = DAYS
        .get(usize::try_from(days % 7).unwrap_or(0))
        .copied()
        .unwrap_or("Thu");
    let month_name = MONTHS
        .get(usize::try_from(month.saturating_sub(1)).unwrap_or(0))
        .copied()
        .unwrap_or("Jan");
    format!("{weekday}, {day:02} {month_name} {year:04} {h:02}:{m:02}:{s:02} GMT")
}

#[cfg(test)]
#[path = "degraded_tests.rs"]
mod tests;
