//! `--store redis+cluster://…`: the seeds, the replicas every write waits
//! for and how long (see the store's header, "Acknowledged means
//! replicated").

/// How long a script's `WAIT` waits for its replicas before the request
/// fails (`503`), by default (`?wait_ms=N` in the URL, at most
/// [`MAX_WAIT_MS`]): well within the request's deadline.
pub const WAIT_MS: u64 = 100;

/// The longest `?wait_ms` accepted: a node's sync request times out after
/// a second or so, and an answer it no longer waits for is wasted.
pub const MAX_WAIT_MS: u64 = 1_000;

/// What `--store redis+cluster://…` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    /// Seed nodes, each `redis://[user:pass@]host:port`.
    pub nodes: Vec<String>,
    /// Replicas every write waits for (`WAIT`).
    pub replicas: u64,
    /// How long each `WAIT` waits for them, in ms.
    pub wait_ms: u64,
}

impl ClusterSpec {
    /// Parses `redis+cluster://[user:pass@]host:port[,host:port…][/][?replicas=N][&wait_ms=N]`.
    pub fn parse(url: &str) -> Result<ClusterSpec, String> {
        let bad = |why: &str| {
            format!("{url}: {why} (expected redis+cluster://host:port,host:port[?replicas=N&wait_ms=N])")
        };
        let rest = url
            .strip_prefix("redis+cluster://")
            .ok_or_else(|| bad("not a redis+cluster:// URL"))?;
        let (hosts, query) = match rest.split_once('?') {
            Some((h, q)) => (h, Some(q)),
            None => (rest, None),
        };
        let hosts = hosts.strip_suffix('/').unwrap_or(hosts);
        let (auth, hosts) = match hosts.rsplit_once('@') {
            Some((a, h)) => (Some(a), h),
            None => (None, hosts),
        };
        let mut nodes = Vec::new();
        for h in hosts.split(',') {
            let valid = h
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !valid {
                return Err(bad(&format!("`{h}` is not host:port")));
            }
            nodes.push(match auth {
                Some(a) => format!("redis://{a}@{h}"),
                None => format!("redis://{h}"),
            });
        }
        let mut replicas = 1;
        let mut wait_ms = WAIT_MS;
        for kv in query.into_iter().flat_map(|q| q.split('&')) {
            match kv.split_once('=') {
                Some(("replicas", n)) => {
                    replicas = n
                        .parse::<u64>()
                        .ok()
                        .filter(|n| *n <= 16)
                        .ok_or_else(|| bad("replicas must be 0 to 16"))?;
                }
                Some(("wait_ms", n)) => {
                    wait_ms = n
                        .parse::<u64>()
                        .ok()
                        .filter(|n| (1..=MAX_WAIT_MS).contains(n))
                        .ok_or_else(|| bad(&format!("wait_ms must be 1 to {MAX_WAIT_MS}")))?;
                }
                _ => return Err(bad(&format!("unknown parameter `{kv}`"))),
            }
        }
        Ok(ClusterSpec {
            nodes,
            replicas,
            wait_ms,
        })
    }
}
