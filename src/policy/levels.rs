//! `levels:` budgets that nest above the tenant: an organisation's budget
//! shared by its teams, each team's by its users (the tenants).
//!
//! The levels form one chain, root first (`org`, then `team` with
//! `parent: org`); the tenant sits below the last. Each level's value comes
//! from a trusted source only: a claim of the verified JWT payload the
//! tenant's identity is read from, or (beside a header identity) a header
//! a trusted earlier filter sets. Every value of a level has its own budget
//! of the level's `limits`, keyed per API action like the tenant's.
//!
//! **Shares within the parent.** A member (a value of a level, e.g. the
//! team `search`) may have a `guarantee`: that percent of its parent's
//! limits is kept for it alone, in a budget of its own (rate and burst
//! scaled), and the parent's pool is what is left (`100 − Σ guarantees`
//! percent). A request of a guaranteed member takes its guaranteed budget
//! first and the pool only when that is spent; everyone else takes the
//! pool. So the parent's total never exceeds its limits (the guaranteed
//! budgets and the pool add up to them), and a quiet member keeps its
//! guarantee however hard the others flood the pool: hierarchical token
//! buckets, as `tc`'s HTB shares a link (assured rate, then borrowing). A
//! member's `ceiling` replaces the level's `limits` for it by that percent
//! of its parent's.

use std::collections::BTreeMap;
use std::rc::Rc;

use hashbrown::HashMap;

use super::error::{Errors, FieldPath};
use super::limits::{compile_limits, Owner};
use super::spec::{LevelMemberSpec, LevelSpec, LimitSpec, Sharing};
use super::values::is_header_name;
use super::{fnv1a32, is_name, Identity, Limit};
pub use crate::decision::MAX_LEVELS;
use crate::table::MAX_KEY_LEN;

/// The compiled `levels:` chain, root first (empty: no levels).
#[derive(Debug, Default)]
pub struct Levels {
    pub chain: Vec<Level>,
}

/// Where a level's value is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LevelSource {
    /// A claim of the JWT payload the identity comes from: the property
    /// path `metadata.filter_metadata.<filter>.<payload>.<claim>`.
    Claim {
        filter: String,
        payload_in_metadata: String,
        claim: String,
    },
    /// A request header (lower-cased) a trusted earlier filter sets.
    Header(String),
}

impl Levels {
    /// Every limit of every level's budgets (pools, guaranteed shares,
    /// ceilings).
    pub fn limits(&self) -> impl Iterator<Item = &Limit> {
        self.chain.iter().flat_map(|l| {
            core::iter::once(&l.pool)
                .chain(l.guaranteed.values())
                .chain(l.ceilings.values())
                .flat_map(|s| s.limits.iter())
        })
    }
}

impl LevelSource {
    /// The property path of a [`LevelSource::Claim`].
    pub fn property_path(&self) -> Option<[&str; 5]> {
        match self {
            LevelSource::Header(_) => None,
            LevelSource::Claim {
                filter,
                payload_in_metadata,
                claim,
            } => Some(["metadata", "filter_metadata", filter, payload_in_metadata, claim]),
        }
    }
}

/// One compiled level.
#[derive(Debug)]
pub struct Level {
    pub name: Rc<str>,
    pub source: LevelSource,
    /// Every value's budget once its members' guarantees are taken out
    /// (the level's `limits` scaled to `100 − Σ guarantees` percent;
    /// empty: the level has no budget of its own). Limits are named
    /// `<level>:<limit>`, as `RateLimit` items and problem bodies name them.
    pub pool: Share,
    /// The guaranteed budget, within this level, of each member of the
    /// level below with a `guarantee`.
    pub guaranteed: HashMap<String, Share>,
    /// The budget of each member of this level with a `ceiling`: it
    /// replaces the pool for that member.
    pub ceilings: HashMap<String, Share>,
    /// The key table's overflow entry of this level's keys (`:<level>`: no
    /// plan name has a colon).
    pub overflow: String,
    /// Each value's pool is shared max-min fairly while it is short
    /// (`sharing: max_min`, see [`crate::limiter::fair`]); else first come.
    pub fair: bool,
    /// The overflow entry of the pools' fairness tables (`:<level>:fair`).
    pub fair_overflow: String,
}

/// A set of limits charged on one key, with its `RateLimit-Policy` value.
#[derive(Debug, Default)]
pub struct Share {
    pub limits: Vec<Limit>,
    pub ratelimit_policy: String,
}

/// Which of a level's budgets a request takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget<'a> {
    /// The pool of the level's value (or its ceiling, which replaces it).
    Pool,
    /// The guaranteed share of `member`, the request's value one level down.
    Guaranteed { member: &'a str },
    /// The fairness table of the pool (see [`crate::limiter::fair`]).
    Fair,
}

/// Writes the logical key of `level`'s budget for the request whose level
/// values (root first, `None`: missing) are `values`, for `action`:
/// `<action>|l|<level>|<value>|…` with each value length-prefixed
/// (`4:acme`) or `-` when missing, so no two paths share a key whatever
/// bytes the values hold; a guaranteed share adds `g|<len>:<member>`, the pool's fairness table `|f`. A key
/// longer than the key table holds ([`MAX_KEY_LEN`]: long values at
/// several levels) is written `<action>|l|<level>|#<128-bit FNV-1a of the
/// whole key, hex>` instead (no value starts with `#`). FNV is no
/// cryptographic hash: two such paths could be made to share a budget only
/// by values the trusted source issued.
pub fn write_key(
    out: &mut String,
    action: &str,
    level: usize,
    levels: &Levels,
    values: &[Option<Rc<str>>],
    budget: Budget<'_>,
) {
    use core::fmt::Write;
    out.clear();
    out.push_str(action);
    out.push_str("|l|");
    if let Some(l) = levels.chain.get(level) {
        out.push_str(&l.name);
    }
    let named = out.len();
    for value in values.iter().take(level.saturating_add(1)) {
        out.push('|');
        match value {
            Some(v) => {
                let _ = write!(out, "{}:{v}", v.len());
            }
            None => out.push('-'),
        }
    }
    match budget {
        Budget::Guaranteed { member } => {
            let _ = write!(out, "|g|{}:{member}", member.len());
        }
        Budget::Fair => out.push_str("|f"),
        Budget::Pool => {}
    }
    if out.len() > MAX_KEY_LEN {
        let digest = fnv1a128(out.as_bytes());
        out.truncate(named);
        let _ = write!(out, "|#{digest:032x}");
    }
}

/// FNV-1a, 128 bits.
fn fnv1a128(bytes: &[u8]) -> u128 {
    bytes
        .iter()
        .fold(0x6c62_272e_07bb_0142_62b8_2175_6295_c58d_u128, |h, b| {
            (h ^ u128::from(*b)).wrapping_mul(0x0000_0000_0100_0000_0000_0000_0000_013b)
        })
}

/// Compiles `levels:` (see the module's documentation for the rules it
/// checks: sources, the chain, shares).
pub(super) fn compile_levels(
    specs: &[LevelSpec],
    identity: &Identity,
    settles: bool,
    path: &FieldPath,
    errors: &mut Errors,
) -> Levels {
    if specs.is_empty() {
        return Levels::default();
    }
    if specs.len() > MAX_LEVELS {
        errors.add(path.clone(), format!("at most {MAX_LEVELS} levels"));
        return Levels::default();
    }
    let Some(order) = chain_order(specs, path, errors) else {
        return Levels::default();
    };
    let mut chain = Vec::with_capacity(order.len());
    for (depth, &i) in order.iter().enumerate() {
        let Some(spec) = specs.get(i) else { continue };
        let at = path.index(i);
        let parent = depth
            .checked_sub(1)
            .and_then(|d| order.get(d))
            .and_then(|&p| specs.get(p).map(|s| (p, s)));
        let child = order
            .get(depth.saturating_add(1))
            .and_then(|&c| specs.get(c).map(|s| (c, s)));
        chain.push(compile_level(
            spec, parent, child, identity, settles, &at, path, errors,
        ));
    }
    Levels { chain }
}

/// The levels in chain order (root first), or `None` after reporting
/// what makes them no chain: names, parents, a cycle, two roots or two
/// children of one level.
fn chain_order(specs: &[LevelSpec], path: &FieldPath, errors: &mut Errors) -> Option<Vec<usize>> {
    let before = errors.0.len();
    let index: BTreeMap<&str, usize> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), i))
        .collect();
    for (i, spec) in specs.iter().enumerate() {
        let at = path.index(i);
        if !is_name(&spec.name) {
            errors.add(
                at.key("name"),
                "level names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
            );
        }
        if specs.iter().take(i).any(|s| s.name == spec.name) {
            errors.add(at.key("name"), format!("duplicate level `{}`", spec.name));
        }
        if let Some(parent) = &spec.parent {
            if !index.contains_key(parent.as_str()) {
                let names: Vec<&str> = index.keys().copied().collect();
                errors.add(
                    at.key("parent"),
                    format!("unknown level `{parent}` (levels: {})", names.join(", ")),
                );
            } else if *parent == spec.name {
                errors.add(at.key("parent"), "a level cannot be its own parent");
            }
        }
    }
    for (i, spec) in specs.iter().enumerate() {
        if let Some(cycle) = cycle_from(specs, &index, i) {
            errors.add(
                path.index(i).key("parent"),
                format!("the levels form a cycle: {cycle}"),
            );
            return None;
        }
        let siblings: Vec<&str> = specs
            .iter()
            .filter(|s| s.parent == spec.parent)
            .map(|s| s.name.as_str())
            .collect();
        if siblings.len() > 1 && siblings.first() == Some(&spec.name.as_str()) {
            let of = spec
                .parent
                .as_deref()
                .map_or_else(|| String::from("the root"), |p| format!("`{p}`"));
            errors.add(
                path.index(i).key("parent"),
                format!("levels form one chain: {} all nest in {of}", siblings.join(", ")),
            );
        }
    }
    if errors.0.len() > before {
        return None;
    }
    let mut order = Vec::with_capacity(specs.len());
    let mut parent: Option<&str> = None;
    while let Some(i) = specs.iter().position(|s| s.parent.as_deref() == parent) {
        order.push(i);
        parent = specs.get(i).map(|s| s.name.as_str());
        if order.len() > specs.len() {
            break;
        }
    }
    if order.len() != specs.len() {
        errors.add(path.clone(), "exactly one level has no `parent` (the root)");
        return None;
    }
    Some(order)
}

/// The cycle through level `start`'s parents, as `a → b → a`, if any.
fn cycle_from(specs: &[LevelSpec], index: &BTreeMap<&str, usize>, start: usize) -> Option<String> {
    let mut seen = vec![start];
    let mut at = start;
    while let Some(&p) = specs
        .get(at)
        .and_then(|s| s.parent.as_deref())
        .and_then(|p| index.get(p))
    {
        if p == start {
            seen.push(p);
            let names: Vec<&str> = seen
                .iter()
                .filter_map(|&i| specs.get(i).map(|s| s.name.as_str()))
                .collect();
            return Some(names.join(" → "));
        }
        if seen.contains(&p) || seen.len() > specs.len() {
            return None;
        }
        seen.push(p);
        at = p;
    }
    None
}

/// One level: its source, its pool, its members' ceilings and the
/// guarantees of the members of the level below (`child`).
#[allow(clippy::too_many_arguments)]
fn compile_level(
    spec: &LevelSpec,
    parent: Option<(usize, &LevelSpec)>,
    child: Option<(usize, &LevelSpec)>,
    identity: &Identity,
    settles: bool,
    at: &FieldPath,
    levels_path: &FieldPath,
    errors: &mut Errors,
) -> Level {
    let name: Rc<str> = Rc::from(spec.name.as_str());
    let source = compile_source(spec, identity, at, errors);
    if parent.is_none() && spec.limits.is_empty() {
        errors.add(at.key("limits"), "the root level needs at least one limit");
    }
    let own_name = Naming {
        owner: &spec.name,
        level: &spec.name,
        member: None,
    };
    let own = share(&own_name, &spec.limits, 100, settles, &at.key("limits"), errors);
    check_members(spec, parent.map(|(_, p)| p), at, errors);
    let guarantees: Vec<(&String, i64)> = child
        .iter()
        .flat_map(|(_, c)| c.members.iter())
        .filter_map(|(m, s)| s.guarantee.map(|g| (m, g)))
        .collect();
    let taken: i64 = guarantees.iter().map(|(_, g)| g).sum();
    let mut guaranteed = HashMap::new();
    if let Some((c, _)) = child.filter(|_| taken > 0 && taken < 100) {
        for (member, pct) in &guarantees {
            let member_at = levels_path.index(c).key("members").key(member).key("guarantee");
            check_scaled(&spec.limits, *pct, &member_at, errors);
            guaranteed.insert(
                (*member).clone(),
                share(
                    &Naming {
                        owner: &spec.name,
                        level: &spec.name,
                        member: Some(member),
                    },
                    &spec.limits,
                    *pct,
                    settles,
                    &member_at,
                    &mut Errors(Vec::new()),
                ),
            );
        }
    }
    if let Some((c, _)) = child.filter(|_| taken >= 100) {
        errors.add(
            levels_path.index(c).key("members"),
            format!("the guarantees add up to {taken} % of `{}`: at most 99, leaving a pool for the members without one", spec.name),
        );
    }
    let pool = if taken > 0 && taken < 100 {
        check_scaled(&spec.limits, 100 - taken, &at.key("limits"), errors);
        share(
            &own_name,
            &spec.limits,
            100 - taken,
            settles,
            &at.key("limits"),
            &mut Errors(Vec::new()),
        )
    } else {
        own
    };
    let mut ceilings = HashMap::new();
    for (member, m) in &spec.members {
        let (Some(pct), Some((_, p))) = (m.ceiling, parent) else {
            continue;
        };
        let member_at = at.key("members").key(member).key("ceiling");
        if taken > 0 {
            errors.add(
                member_at.clone(),
                "a member with a ceiling cannot hold guaranteed shares of the level below (not built yet)",
            );
        }
        check_scaled(&p.limits, pct, &member_at, errors);
        ceilings.insert(
            member.clone(),
            share(
                &Naming {
                    owner: &p.name,
                    level: &spec.name,
                    member: Some(member),
                },
                &p.limits,
                pct,
                settles,
                &member_at,
                &mut Errors(Vec::new()),
            ),
        );
    }
    Level {
        overflow: format!(":{name}"),
        fair: spec.sharing == Sharing::MaxMin,
        fair_overflow: format!(":{name}:fair"),
        name,
        source,
        pool,
        guaranteed,
        ceilings,
    }
}

/// A level's source: exactly one of `claim` (beside a JWT identity: the
/// same verified payload) or `header` (beside a header identity: the
/// same trusted filter). Anything else could be set by the client.
fn compile_source(spec: &LevelSpec, identity: &Identity, at: &FieldPath, errors: &mut Errors) -> LevelSource {
    match (&spec.claim, &spec.header, identity) {
        (
            Some(claim),
            None,
            Identity::JwtClaim {
                filter,
                payload_in_metadata,
                ..
            },
        ) => {
            if claim.is_empty() {
                errors.add(at.key("claim"), "must not be empty");
            }
            LevelSource::Claim {
                filter: filter.clone(),
                payload_in_metadata: payload_in_metadata.clone(),
                claim: claim.clone(),
            }
        }
        (Some(_), None, Identity::Header(_)) => {
            errors.add(
                at.key("claim"),
                "a claim is trusted only from the verified JWT payload the tenant is read from: set `identity.jwt`, or name a `header` a trusted filter sets",
            );
            LevelSource::Header(String::new())
        }
        (None, Some(header), Identity::Header(_)) => {
            if !is_header_name(header) {
                errors.add(
                    at.key("header"),
                    "must be an HTTP header name (letters, digits, - _ .)",
                );
            }
            LevelSource::Header(header.to_ascii_lowercase())
        }
        (None, Some(_), Identity::JwtClaim { .. }) => {
            errors.add(
                at.key("header"),
                "beside a JWT identity a header is whatever the client sends, not a trusted source: name a `claim` of the same payload",
            );
            LevelSource::Header(String::new())
        }
        _ => {
            errors.add(at.clone(), "set exactly one of `claim` or `header`");
            LevelSource::Header(String::new())
        }
    }
}

/// Members' values and shares: valid values, a guarantee of 1–99 % and a
/// ceiling of 1–100 % of a parent (the root has none), the guarantee
/// within the ceiling.
fn check_members(spec: &LevelSpec, parent: Option<&LevelSpec>, at: &FieldPath, errors: &mut Errors) {
    for (member, m) in &spec.members {
        let member_at = at.key("members").key(member);
        if !is_name(member) {
            errors.add(
                member_at.clone(),
                "a member with a share is named like a limit (1 to 64 characters of A-Z a-z 0-9 _ - .): its budget's limits are named after it",
            );
        }
        let LevelMemberSpec { guarantee, ceiling } = m;
        if guarantee.is_none() && ceiling.is_none() {
            errors.add(member_at.clone(), "set a `guarantee`, a `ceiling` or both");
        }
        if let Some(g) = guarantee.filter(|g| !(1..=99).contains(g)) {
            errors.add(
                member_at.key("guarantee"),
                format!("{g}: must be a percent of the parent's limits from 1 to 99"),
            );
        }
        if let Some(c) = ceiling.filter(|c| !(1..=100).contains(c)) {
            errors.add(
                member_at.key("ceiling"),
                format!("{c}: must be a percent of the parent's limits from 1 to 100"),
            );
        }
        if let (Some(g), Some(c)) = (guarantee, ceiling) {
            if g > c {
                errors.add(
                    member_at.key("guarantee"),
                    format!("{g} % is above the member's ceiling of {c} %"),
                );
            }
        }
        let shares = guarantee.is_some() || ceiling.is_some();
        match parent {
            None if shares => errors.add(
                member_at.clone(),
                format!("`{}` is the root: a share is of a parent's limits", spec.name),
            ),
            Some(p) if shares && p.limits.is_empty() => errors.add(
                member_at.clone(),
                format!("a share is of the parent's limits, and `{}` has none", p.name),
            ),
            _ => {}
        }
    }
}

/// Reports a limit of which `pct` percent is less than one unit (its rate
/// or its burst): such a share could never admit anything.
fn check_scaled(limits: &[LimitSpec], pct: i64, at: &FieldPath, errors: &mut Errors) {
    for (i, l) in limits.iter().enumerate() {
        let smallest = l.burst.map_or(l.rate, |b| b.min(l.rate));
        if smallest > 0 && scale(smallest, pct) == 0 {
            errors.add(
                at.clone(),
                format!(
                    "{pct} % of the parent's limits[{i}] is less than one unit: raise the share or the limit"
                ),
            );
        }
    }
}

/// `pct` percent of `n`, rounded down (a share never rounds up).
fn scale(n: i64, pct: i64) -> i64 {
    n.saturating_mul(pct) / 100
}

/// The name of a budget's limits: `<level>:<limit>`, and for a member's
/// share (a guaranteed share of the parent's limit, or a ceiling) also
/// `:<member>`, so that every budget with other parameters has other names
/// (the central service knows a global limit by its name).
struct Naming<'a> {
    /// The level whose `limits` these are (the default name of a lone one).
    owner: &'a str,
    /// The level named first.
    level: &'a str,
    member: Option<&'a str>,
}

/// `limits` scaled to `pct` percent (rate, burst and debt rounded down),
/// compiled and named (see [`Naming`]).
fn share(
    naming: &Naming<'_>,
    limits: &[LimitSpec],
    pct: i64,
    settles: bool,
    at: &FieldPath,
    errors: &mut Errors,
) -> Share {
    if limits.is_empty() {
        return Share::default();
    }
    let scaled: Vec<LimitSpec> = limits.iter().map(|l| scaled_spec(l, pct)).collect();
    let owner = Owner {
        plan: naming.owner,
        limits: scaled.len(),
        global_refused: None,
        soft_refused: Some("a level's budget is shared by every request below it"),
        settles,
    };
    let mut compiled = compile_limits(&owner, &scaled, at, errors);
    for limit in &mut compiled {
        limit.name = match naming.member {
            Some(m) => format!("{}:{}:{m}", naming.level, limit.name),
            None => format!("{}:{}", naming.level, limit.name),
        };
        limit.name_hash = fnv1a32(limit.name.as_bytes());
    }
    let ratelimit_policy = super::compile::ratelimit_policy(&compiled);
    Share {
        limits: compiled,
        ratelimit_policy,
    }
}

fn scaled_spec(l: &LimitSpec, pct: i64) -> LimitSpec {
    let s = |n: i64| if pct == 100 { n } else { scale(n, pct) };
    LimitSpec {
        name: l.name.clone(),
        algorithm: l.algorithm,
        rate: s(l.rate),
        per: l.per.clone(),
        burst: l.burst.map(s),
        shadow: l.shadow,
        global: l.global,
        on_limit: l.on_limit,
        max_debt: l.max_debt.map(s),
        time_zone: l.time_zone.clone(),
    }
}
