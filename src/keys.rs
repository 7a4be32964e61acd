//! The shared-data namespace: every key tenantgate writes in Envoy's
//! shared data, and every kind of record its entries hold. The one module
//! that mints them.
//!
//! # Keys
//! A key is `tg2|<space>|<name>`: `tg2` is the layout's version, `<space>`
//! one of the fixed [`Space`]s below (distinct, none holds a `|`), and
//! `<name>` what the space is about. Names come from the policy, which
//! validates them as `A-Z a-z 0-9 _ - . ~` without `|` (dependencies,
//! actions, guards, classes, plans), or are numbers. So two keys of two
//! spaces differ in their second field, and two keys of one space differ
//! in their names: **no policy can make two keys meet**. Composite names
//! (an overflow's `action|plan`, a degraded slot's `class|slot`) join two
//! `|`-free parts with one `|`, which splits back one way only.
//!
//! Shared data has no delete: a key lives until the process ends, so
//! every space is bounded by the policy (one key per dependency, action,
//! guard, degraded slot, overflow pair) or by the key table's size.
//!
//! # Record kinds
//! An entry's records carry a kind byte ([`crate::table::layout`]); a
//! reader takes only records of its own kind, so two modules can never
//! read each other's bytes. Every kind is here, once.

/// The layout version every key starts with.
const VERSION: &str = "tg2";

/// The spaces of the namespace (the second field of a key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    /// Key-table entries: `tg2|k|<index>` ([`crate::table`]).
    Entry,
    /// Key-table overflow entries: `tg2|o|<action>|<plan>`.
    Overflow,
    /// Global guards: `tg2|g|<guard>`.
    Guard,
    /// A dependency's in-flight slots: `tg2|d|<dependency>`.
    Dependency,
    /// An API action's in-flight slots: `tg2|a|<action>`.
    Action,
    /// A dependency's circuit breaker: `tg2|b|<dependency>`.
    Breaker,
    /// A dependency's adaptive controller: `tg2|c|<dependency>`.
    Control,
    /// A dependency's stream-end signal windows: `tg2|w|<dependency>`.
    Window,
    /// A dependency's retry budget: `tg2|r|<dependency>`.
    RetryBudget,
    /// A degradable class's cached answers: `tg2|v|<class>|<slot>`.
    Degraded,
    /// The node's own records (the worker counter): `tg2|n|<name>`.
    Node,
    /// The node's sync with the central service: `tg2|sync|<name>`.
    Sync,
}

impl Space {
    pub const ALL: [Space; 12] = [
        Space::Entry,
        Space::Overflow,
        Space::Guard,
        Space::Dependency,
        Space::Action,
        Space::Breaker,
        Space::Control,
        Space::Window,
        Space::RetryBudget,
        Space::Degraded,
        Space::Node,
        Space::Sync,
    ];

    /// The space's field in a key.
    pub const fn tag(self) -> &'static str {
        match self {
            Space::Entry => "k",
            Space::Overflow => "o",
            Space::Guard => "g",
            Space::Dependency => "d",
            Space::Action => "a",
            Space::Breaker => "b",
            Space::Control => "c",
            Space::Window => "w",
            Space::RetryBudget => "r",
            Space::Degraded => "v",
            Space::Node => "n",
            Space::Sync => "sync",
        }
    }

    /// `tg2|<tag>|`: what every key of the space starts with.
    pub fn prefix(self) -> String {
        format!("{VERSION}|{}|", self.tag())
    }
}

fn key(space: Space, name: &str) -> String {
    let mut k = String::with_capacity(VERSION.len() + space.tag().len() + name.len() + 2);
    k.push_str(VERSION);
    k.push('|');
    k.push_str(space.tag());
    k.push('|');
    k.push_str(name);
    k
}

/// The prefix of key-table entries (`tg2|k|`), which
/// [`crate::table::layout::EntryKey`] formats on the stack.
pub const ENTRY_PREFIX: &str = "tg2|k|";

/// A dependency's in-flight entry.
pub fn dependency(name: &str) -> String {
    key(Space::Dependency, name)
}

/// An API action's in-flight entry (`actions.<name>`).
pub fn action(name: &str) -> String {
    key(Space::Action, name)
}

/// A dependency's circuit breaker.
pub fn breaker(dependency: &str) -> String {
    key(Space::Breaker, dependency)
}

/// A dependency's adaptive controller.
pub fn control(dependency: &str) -> String {
    key(Space::Control, dependency)
}

/// A dependency's signal windows.
pub fn window(dependency: &str) -> String {
    key(Space::Window, dependency)
}

/// A dependency's retry budget.
pub fn retry_budget(dependency: &str) -> String {
    key(Space::RetryBudget, dependency)
}

/// A global guard.
pub fn guard(name: &str) -> String {
    key(Space::Guard, name)
}

/// The overflow entry of `action` × `plan` (a key that found no slot in
/// the key table shares it with every other such key).
pub fn overflow(action: &str, plan: &str) -> String {
    key(Space::Overflow, &format!("{action}|{plan}"))
}

/// One of a degradable class's cache slots.
pub fn degraded(class: &str, slot: u64) -> String {
    key(Space::Degraded, &format!("{class}|{slot}"))
}

/// The counter worker ids are drawn from.
pub const WORKER_COUNTER: &str = "tg2|n|workers";
/// The node's session id ([`crate::sync::boot`]).
pub const SYNC_BOOT: &str = "tg2|sync|boot";
/// The node's sync state ([`crate::sync::stored`]).
pub const SYNC_STATE: &str = "tg2|sync|state";
/// Counts carried from a report that was given up on.
pub const SYNC_CARRIED: &str = "tg2|sync|carried";

/// Record kinds (the kind byte of a record in an entry).
pub mod kind {
    /// A token bucket's state.
    pub const TOKEN_BUCKET: u8 = 1;
    /// A fixed window's state.
    pub const FIXED_WINDOW: u8 = 2;
    /// A sliding window log.
    pub const SLIDING_WINDOW_LOG: u8 = 3;
    /// A sliding window counter.
    pub const SLIDING_WINDOW_COUNTER: u8 = 4;
    /// A global limit's leased allowance.
    pub const GLOBAL_ALLOWANCE: u8 = 5;
    /// In-flight holders of a dependency, an action or a tenant's share.
    pub const IN_FLIGHT: u8 = 16;
    /// The worker-id counter.
    pub const WORKER_COUNTER: u8 = 17;
    /// A dependency's signal windows.
    pub const WINDOW: u8 = 18;
    /// An adaptive controller's state.
    pub const CONTROL: u8 = 19;
    /// A circuit breaker's state.
    pub const BREAKER: u8 = 20;
    /// A retry budget's buckets.
    pub const RETRY_BUDGET: u8 = 21;
    /// A cached (degraded) answer.
    pub const DEGRADED: u8 = 22;

    /// A nested level's pool: its members' demand and use.
    pub const FAIR_TABLE: u8 = 23;

    /// Every kind, for the uniqueness test.
    pub const ALL: [u8; 13] = [
        TOKEN_BUCKET,
        FIXED_WINDOW,
        SLIDING_WINDOW_LOG,
        SLIDING_WINDOW_COUNTER,
        GLOBAL_ALLOWANCE,
        IN_FLIGHT,
        WORKER_COUNTER,
        WINDOW,
        CONTROL,
        BREAKER,
        RETRY_BUDGET,
        DEGRADED,
        FAIR_TABLE,
    ];
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::table::layout::EntryKey;

    #[test]
    fn spaces_and_kinds_are_unique() {
        let tags: HashSet<&str> = Space::ALL.iter().map(|s| s.tag()).collect();
        assert_eq!(tags.len(), Space::ALL.len());
        assert!(Space::ALL.iter().all(|s| !s.tag().contains('|')));
        let kinds: HashSet<u8> = kind::ALL.into_iter().collect();
        assert_eq!(kinds.len(), kind::ALL.len());
    }

    #[test]
    fn every_key_is_in_its_space() {
        assert_eq!(ENTRY_PREFIX, Space::Entry.prefix());
        assert!(EntryKey::new(7).as_str().starts_with(&Space::Entry.prefix()));
        assert!(WORKER_COUNTER.starts_with(&Space::Node.prefix()));
        for k in [SYNC_BOOT, SYNC_STATE, SYNC_CARRIED] {
            assert!(k.starts_with(&Space::Sync.prefix()), "{k}");
        }
        type Mint = fn(&str) -> String;
        let named: [(Mint, Space); 7] = [
            (dependency, Space::Dependency),
            (action, Space::Action),
            (breaker, Space::Breaker),
            (control, Space::Control),
            (window, Space::Window),
            (retry_budget, Space::RetryBudget),
            (guard, Space::Guard),
        ];
        for (mint, space) in named {
            assert_eq!(mint("x"), format!("{}x", space.prefix()));
        }
        assert!(overflow("a", "p").starts_with(&Space::Overflow.prefix()));
        assert!(degraded("c", 3).starts_with(&Space::Degraded.prefix()));
    }

    /// No name a policy accepts can make two keys meet: every minting
    /// function over every name from an adversarial alphabet (including
    /// the names of other spaces' fixed keys) gives distinct keys.
    #[test]
    fn no_policy_name_makes_two_keys_meet() {
        let names = [
            "workers", "boot", "state", "carried", "k", "o", "g", "d", "a", "b", "c", "w", "r", "v", "n",
            "sync", "0", "1", "12", "db", "~d.db", "x.y", "a-b", "A_B", "tenant",
        ];
        let mut seen: HashSet<String> = HashSet::new();
        let mut add = |k: String| assert!(seen.insert(k.clone()), "two keys meet at {k}");
        for k in [WORKER_COUNTER, SYNC_BOOT, SYNC_STATE, SYNC_CARRIED] {
            add(k.to_owned());
        }
        for i in 0..64 {
            add(EntryKey::new(i).as_str().to_owned());
        }
        for n in names {
            for mint in [dependency, action, breaker, control, window, retry_budget, guard] {
                add(mint(n));
            }
            for m in names {
                add(overflow(n, m));
            }
            for slot in 0..4 {
                add(degraded(n, slot));
            }
        }
    }
}
