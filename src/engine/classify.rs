//! Classifying and identifying a request: its route class from trusted
//! route configuration only, and its subject from the policy's identity
//! source (a trusted header, a JWT claim a verified filter wrote, or the
//! client's address as Envoy or a trusted hop saw it).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::rc::Rc;

use super::Subject;
use crate::host::Host;
use crate::policy::{
    self, Classification, Policy, RouteClass, ROUTE_METADATA_CLASS_FIELD, ROUTE_METADATA_NAMESPACE,
};

/// Property path of the route's class in its `filter_metadata`.
pub const ROUTE_CLASS_PROPERTY: [&str; 5] = [
    "xds",
    "route_metadata",
    "filter_metadata",
    ROUTE_METADATA_NAMESPACE,
    ROUTE_METADATA_CLASS_FIELD,
];
/// Property path of the route's name (what Istio users can set).
pub const ROUTE_NAME_PROPERTY: [&str; 2] = ["xds", "route_name"];
/// Property path of the downstream address (`ip:port`).
pub const SOURCE_ADDRESS_PROPERTY: [&str; 2] = ["source", "address"];

/// The route class from trusted route metadata, else the route name, else
/// the policy's default class. Nothing the client sends is consulted.
/// With `class:` (one filter instance per class), nothing is read at all.
/// The one classifier: a host that needs a request's class (the module,
/// for its failure mode after a caught panic) asks here.
pub fn class_of<'p, H: Host>(policy: &'p Policy, host: &H) -> Option<&'p Rc<RouteClass>> {
    let name = match &policy.classification {
        Classification::Instance(class) => return Some(class),
        Classification::RouteName => host.property(&ROUTE_NAME_PROPERTY),
        Classification::RouteMetadata => host
            .property(&ROUTE_CLASS_PROPERTY)
            .or_else(|| host.property(&ROUTE_NAME_PROPERTY)),
    };
    policy.route_class(name.as_deref().and_then(|b| core::str::from_utf8(b).ok()))
}

/// Who a request is (the trusted identity, else the anonymous address
/// group) and its plan.
pub fn identify<H: Host>(policy: &Policy, host: &H) -> (Subject, usize) {
    let raw = match &policy.identity {
        policy::Identity::Header(name) => host.request_header(name),
        id @ policy::Identity::JwtClaim { .. } => id.property_path().and_then(|p| host.property(&p)),
    };
    if let Some(id) = raw.as_deref().and_then(policy::tenant_id) {
        return (Subject::Tenant(id.into()), policy.plan_of_tenant(id));
    }
    let invalid_identity = raw.is_some_and(|r| !r.is_empty());
    let address = client_address(&policy.anonymous, host).map_or_else(|| Rc::from("unknown"), Rc::from);
    (
        Subject::Anonymous {
            address,
            invalid_identity,
        },
        policy.anonymous_plan(),
    )
}

/// A tenant's value at each nested level (`levels:`, root first), each
/// from its level's trusted source; `None` where it is missing or not a
/// usable value (1–128 bytes of UTF-8, no whitespace or control
/// characters, as a tenant id). Anonymous requests belong to no level.
pub fn identify_levels<H: Host>(policy: &Policy, host: &H, subject: &Subject) -> Vec<Option<Rc<str>>> {
    if policy.levels.chain.is_empty() || !matches!(subject, Subject::Tenant(_)) {
        return Vec::new();
    }
    policy
        .levels
        .chain
        .iter()
        .map(|level| {
            let raw = match &level.source {
                policy::levels::LevelSource::Header(name) => host.request_header(name),
                claim => claim.property_path().and_then(|p| host.property(&p)),
            };
            raw.as_deref().and_then(policy::tenant_id).map(Rc::from)
        })
        .collect()
}

/// The anonymous client's address, grouped by the configured prefix: the
/// N-th address from the right of `X-Forwarded-For` with N trusted hops,
/// else (and when XFF is shorter than N) the connection's address.
pub fn client_address<H: Host>(config: &policy::Anonymous, host: &H) -> Option<String> {
    let from_xff = (config.xff_trusted_hops > 0)
        .then(|| host.request_header("x-forwarded-for"))
        .flatten()
        .and_then(|xff| nth_from_right(&xff, config.xff_trusted_hops));
    let ip = match from_xff {
        Some(ip) => ip,
        None => host
            .property(&SOURCE_ADDRESS_PROPERTY)
            .and_then(|a| client_ip(&a)?.parse().ok())?,
    };
    Some(group(ip, config.ipv4_prefix, config.ipv6_prefix))
}

fn nth_from_right(xff: &[u8], n: u32) -> Option<IpAddr> {
    let text = core::str::from_utf8(xff).ok()?;
    let entry = text.rsplit(',').nth((n as usize).checked_sub(1)?)?.trim();
    // Accept `ip`, `[v6]` and `[v6]:port`; anything else is not an address.
    let entry = entry
        .strip_prefix('[')
        .and_then(|e| e.split(']').next())
        .unwrap_or(entry);
    entry.parse().ok()
}

/// The address as text, masked to its group (`203.0.113.0/24`,
/// `2001:db8:1:2::/64`); a full-length prefix prints the bare address. An
/// IPv4-mapped IPv6 address (`::ffff:a.b.c.d`, how a dual-stack listener
/// reports IPv4 clients) is grouped as the IPv4 address it is: masked as
/// IPv6, every IPv4 client would share `::/64`.
fn group(ip: IpAddr, v4_prefix: u8, v6_prefix: u8) -> String {
    match ip.to_canonical() {
        IpAddr::V4(v4) if v4_prefix >= 32 => v4.to_string(),
        IpAddr::V4(v4) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(v4_prefix)).unwrap_or(0);
            format!("{}/{v4_prefix}", Ipv4Addr::from(u32::from(v4) & mask))
        }
        IpAddr::V6(v6) if v6_prefix >= 128 => v6.to_string(),
        IpAddr::V6(v6) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(v6_prefix)).unwrap_or(0);
            format!("{}/{v6_prefix}", Ipv6Addr::from(u128::from(v6) & mask))
        }
    }
}

/// The IP part of Envoy's `ip:port` / `[v6]:port` address text.
pub fn client_ip(address: &[u8]) -> Option<&str> {
    let text = core::str::from_utf8(address).ok()?;
    let ip = if let Some(rest) = text.strip_prefix('[') {
        rest.split(']').next()?
    } else if text.bytes().filter(|b| *b == b':').count() == 1 {
        text.split(':').next()?
    } else {
        text
    };
    let plausible = !ip.is_empty()
        && ip.len() <= 64
        && ip
            .bytes()
            .all(|b| b.is_ascii_hexdigit() || b == b'.' || b == b':');
    plausible.then_some(ip)
}
