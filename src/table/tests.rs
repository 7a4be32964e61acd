//! The key table through its one primitive, with a toy record: one counter
//! per key (kind 1), idle when it is zero.

use std::cell::RefCell;
use std::rc::Rc;

use super::*;
use crate::memory::{MemoryHost, SharedStore};

const NOW: u64 = 1_796_000_000_000_000_000;

fn idle(r: &Record<'_>, _now: u64) -> bool {
    r.state.iter().all(|b| *b == 0)
}

const INSERT: Reach<'static> = Reach::Insert { is_idle: &idle };

fn count_of(records: Option<&Records<'_>>) -> u64 {
    records
        .and_then(|rs| rs.first().copied())
        .and_then(|r| r.state.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

fn write_count(out: &mut Vec<u8>, count: u64) {
    out.push(1);
    push_record(out, 7, 1, 0, 0, &count.to_le_bytes());
}

/// Adds `delta` to the key's counter (`Commit::Write`); returns the new count.
fn add(host: &MemoryHost, place: &Place<'_>, reach: &Reach<'_>, delta: u64) -> Result<Updated<u64>, Failure> {
    update(
        host,
        place,
        reach,
        NOW,
        &mut Buffers::default(),
        |records, out| {
            let count = count_of(records) + delta;
            write_count(out, count);
            (Commit::Write, count)
        },
    )
}

fn table<'a>(logical: &'a str, entries: u64) -> Place<'a> {
    Place::Table {
        logical: logical.as_bytes(),
        entries,
        overflow: Overflow {
            action: "api",
            plan: "free",
        },
    }
}

/// Keys whose home entry (of `entries`) is `home`.
fn keys_homed_at(home: u64, entries: u64, n: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("api|t|k{i}"))
        .filter(|k| fnv1a64(k.as_bytes()) % entries == home)
        .take(n)
        .collect()
}

fn slot_keys(store: &Rc<RefCell<SharedStore>>, entry: &str) -> Vec<Vec<u8>> {
    let store = store.borrow();
    let slots = decode_entry(store.get(entry).unwrap()).unwrap();
    slots.iter().map(|s| s.key.to_vec()).collect()
}

fn store_with() -> (Rc<RefCell<SharedStore>>, MemoryHost) {
    let store = SharedStore::new();
    let host = MemoryHost::new(store.clone());
    (store, host)
}

#[test]
fn a_key_is_placed_in_its_home_entry_then_the_next_and_keeps_its_slot() {
    let (store, host) = store_with();
    let entries = 4;
    let keys = keys_homed_at(1, entries, SLOTS_PER_ENTRY + 1);
    for k in &keys[..SLOTS_PER_ENTRY] {
        let u = add(&host, &table(k, entries), &INSERT, 1).unwrap();
        assert_eq!((u.event, u.result, u.written), (TableEvent::Inserted, 1, true));
    }
    let home = decode_entry(store.borrow().get("tg2|k|1").unwrap())
        .unwrap()
        .len();
    assert_eq!(home, SLOTS_PER_ENTRY);
    // The home entry is full of busy keys: the next entry takes the ninth.
    let last = &keys[SLOTS_PER_ENTRY];
    assert_eq!(
        add(&host, &table(last, entries), &INSERT, 1).unwrap().event,
        TableEvent::Inserted
    );
    assert_eq!(slot_keys(&store, "tg2|k|2"), vec![last.as_bytes().to_vec()]);
    // Every key finds its own slot again, in either entry.
    for k in &keys {
        let u = add(&host, &table(k, entries), &INSERT, 1).unwrap();
        assert_eq!((u.event, u.result), (TableEvent::None, 2), "{k}");
    }
}

#[test]
fn an_idle_slot_is_reclaimed_and_a_busy_one_never_is() {
    let (store, host) = store_with();
    let keys = keys_homed_at(0, 1, SLOTS_PER_ENTRY + 2);
    for k in &keys[..SLOTS_PER_ENTRY] {
        add(&host, &table(k, 1), &INSERT, 1).unwrap();
    }
    // Every slot busy: overflow, and the table is untouched.
    let before = store.borrow().get("tg2|k|0").unwrap().to_vec();
    let u = add(&host, &table(&keys[SLOTS_PER_ENTRY], 1), &INSERT, 1).unwrap();
    assert_eq!(u.event, TableEvent::Overflow);
    assert_eq!(store.borrow().get("tg2|k|0").unwrap(), &before[..]);
    // One key goes idle (its counter back to zero): the next newcomer takes its slot.
    let idle_key = &keys[3];
    update(
        &host,
        &table(idle_key, 1),
        &Reach::Existing,
        NOW,
        &mut Buffers::default(),
        |_, out| {
            write_count(out, 0);
            (Commit::Write, ())
        },
    )
    .unwrap();
    let newcomer = &keys[SLOTS_PER_ENTRY + 1];
    let u = add(&host, &table(newcomer, 1), &INSERT, 1).unwrap();
    assert_eq!((u.event, u.result), (TableEvent::Reclaimed, 1));
    let slots = slot_keys(&store, "tg2|k|0");
    assert_eq!(slots.len(), SLOTS_PER_ENTRY);
    assert!(slots.iter().any(|s| s == newcomer.as_bytes()));
    assert!(!slots.iter().any(|s| s == idle_key.as_bytes()));
}

#[test]
fn overflowing_keys_share_one_bounded_entry_and_existing_reach_never_inserts() {
    let (store, host) = store_with();
    let keys = keys_homed_at(0, 1, SLOTS_PER_ENTRY + 20);
    for k in &keys[..SLOTS_PER_ENTRY] {
        add(&host, &table(k, 1), &INSERT, 1).unwrap();
    }
    for (i, k) in keys[SLOTS_PER_ENTRY..].iter().enumerate() {
        let u = add(&host, &table(k, 1), &INSERT, 1).unwrap();
        assert_eq!((u.event, u.result), (TableEvent::Overflow, i as u64 + 1));
    }
    // Two entries in all, however many keys overflowed.
    assert_eq!(store.borrow().len(), 2);
    assert_eq!(
        decode_entry(store.borrow().get("tg2|o|api|free").unwrap())
            .unwrap()
            .len(),
        1
    );
    // An update of an absent key touches nothing.
    let absent = add(&host, &table("api|t|nobody", 1), &Reach::Existing, 1);
    assert_eq!(absent, Err(Failure::Absent));
    assert_eq!(
        add(&host, &Place::Fixed { key: "tg2|g|x" }, &Reach::Existing, 1),
        Err(Failure::Absent)
    );
    assert_eq!(store.borrow().len(), 2);
}

#[test]
fn conflicts_are_retried_up_to_the_bound_then_exhaustion_is_an_error() {
    let (store, host) = store_with();
    let place = table("api|t|a", 8);
    add(&host, &place, &INSERT, 1).unwrap();
    // One attempt short of the bound: written, with every retry counted.
    *host.forced_conflicts.borrow_mut() = MAX_CAS_ATTEMPTS - 1;
    let mut calls = 0;
    let u = update(
        &host,
        &place,
        &INSERT,
        NOW,
        &mut Buffers::default(),
        |records, out| {
            calls += 1;
            write_count(out, count_of(records) + 1);
            (Commit::Write, ())
        },
    )
    .unwrap();
    assert_eq!(
        (u.retries, u.written, calls),
        (MAX_CAS_ATTEMPTS - 1, true, MAX_CAS_ATTEMPTS)
    );
    // The closure runs once per attempt, on the entry as re-read.
    assert_eq!(add(&host, &place, &INSERT, 0).unwrap().result, 2);
    // At the bound: an error, and nothing written.
    let before = store.borrow().get("tg2|k|0").map(<[u8]>::to_vec);
    *host.forced_conflicts.borrow_mut() = MAX_CAS_ATTEMPTS;
    assert_eq!(add(&host, &place, &INSERT, 1), Err(Failure::Exhausted));
    assert_eq!(store.borrow().get("tg2|k|0").map(<[u8]>::to_vec), before);
}

#[test]
fn a_best_effort_write_is_tried_once_and_skip_writes_nothing() {
    let (store, host) = store_with();
    let place = table("api|t|a", 8);
    add(&host, &place, &INSERT, 1).unwrap();
    *host.forced_conflicts.borrow_mut() = 3;
    let mut calls = 0;
    let u = update(&host, &place, &INSERT, NOW, &mut Buffers::default(), |_, out| {
        calls += 1;
        write_count(out, 9);
        (Commit::BestEffort, ())
    })
    .unwrap();
    assert_eq!((u.written, u.retries, calls), (false, 0, 1));
    let conflicts = store.borrow().conflicts;
    let u = update(&host, &place, &INSERT, NOW, &mut Buffers::default(), |_, _| {
        (Commit::Skip, ())
    })
    .unwrap();
    assert!(!u.written);
    assert_eq!(store.borrow().conflicts, conflicts);
    assert_eq!(add(&host, &place, &INSERT, 0).unwrap().result, 1);
}

#[test]
fn a_broken_host_or_an_unreadable_entry_is_never_a_silent_success() {
    let (store, mut host) = store_with();
    host.fail_shared = true;
    assert_eq!(
        add(&host, &table("api|t|a", 8), &INSERT, 1),
        Err(Failure::Unavailable { retries: 0 })
    );
    host.fail_shared = false;
    // Garbage in the key's home entry: rebuilt from scratch for the key.
    let home = fnv1a64(b"api|t|a") % 8;
    let name = EntryKey::new(home);
    host.shared_set(name.as_str(), &[0xff, 0xfe, 1], None).unwrap();
    let u = add(&host, &table("api|t|a", 8), &INSERT, 1).unwrap();
    assert_eq!((u.event, u.result), (TableEvent::Inserted, 1));
    assert_eq!(
        decode_entry(store.borrow().get(name.as_str()).unwrap())
            .unwrap()
            .len(),
        1
    );
}
