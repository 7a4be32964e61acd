use super::format::put_varint;
use super::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Mode {
    Open,
    Closed,
    Local(u64),
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Old {
    a: u64,
    b: String,
    m: BTreeMap<String, (u64, i64)>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct New {
    a: u64,
    b: String,
    m: BTreeMap<String, (u64, i64)>,
    #[serde(default)]
    added: Option<Mode>,
}

fn enc<T: Serialize>(v: &T) -> Vec<u8> {
    let mut out = Vec::new();
    to_writer(&mut out, v).unwrap();
    out
}

#[test]
fn values_round_trip_compactly() {
    let now_2026: u64 = 1_796_083_200_000_000_000;
    let ints = (
        0u64,
        127u64,
        128u64,
        now_2026,
        u64::MAX,
        -1i64,
        i64::MIN,
        u128::MAX,
    );
    let back: (u64, u64, u64, u64, u64, i64, i64, u128) = from_slice(&enc(&ints)).unwrap();
    assert_eq!(back, ints);
    let rest = (
        1.0f64,
        0.1f64,
        true,
        Some("x".to_owned()),
        None::<u8>,
        vec![Mode::Open, Mode::Closed, Mode::Local(7)],
    );
    let back: (f64, f64, bool, Option<String>, Option<u8>, Vec<Mode>) = from_slice(&enc(&rest)).unwrap();
    assert_eq!(back, rest);
    assert_eq!(enc(&63u64).len(), 1);
    assert_eq!(enc(&now_2026).len(), 9);
    assert_eq!(
        enc(&(now_2026, now_2026 + 2_000_000_000)).len(),
        9 + 5,
        "a timestamp 2 s after the base"
    );
    assert_eq!(enc(&1.0f64).len(), 3, "a round float is short");
    let (a, b) = ("tenant-1|api".to_owned(), "per-min".to_owned());
    let keys = vec![(a.clone(), b.clone()), (a.clone(), b.clone())];
    assert_eq!(
        enc(&keys).len(),
        1 + 1 + 12 + 1 + 7 + 1 + 1,
        "repeated strings by index"
    );
    assert_eq!(from_slice::<Vec<(String, String)>>(&enc(&keys)).unwrap(), keys);
}

#[test]
fn forty_strings_each_repeated_are_written_once_each() {
    // 40 distinct names, each twice: the second of each is an index.
    let names: Vec<String> = (0..40).map(|i| format!("tenant-{i}|api")).collect();
    let twice: Vec<&String> = names.iter().chain(names.iter()).collect();
    let bytes = enc(&twice);
    let literals: usize = names.iter().map(|n| 1 + n.len()).sum();
    assert_eq!(bytes.len(), 1 + literals + 40, "each repeat one byte");
    assert_eq!(
        from_slice::<Vec<String>>(&bytes).unwrap(),
        [names.clone(), names].concat()
    );
}

#[test]
fn an_appended_defaulted_field_reads_older_records_and_newer_records_are_refused() {
    let old = Old {
        a: 5,
        b: "k".into(),
        m: [("r".to_owned(), (1, -2))].into_iter().collect(),
    };
    let new: New = from_slice(&enc(&old)).unwrap();
    assert_eq!((new.a, new.b.as_str(), new.added), (5, "k", None));
    let newer = New {
        added: Some(Mode::Local(3)),
        ..new
    };
    assert!(from_slice::<Old>(&enc(&newer)).is_err());
}

#[test]
fn corrupt_bytes_fail_without_a_large_allocation() {
    // A length of 2^62 with three bytes left.
    let mut bytes = Vec::new();
    put_varint(&mut bytes, 1 << 62);
    bytes.extend([1, 2, 3]);
    assert!(from_slice::<Vec<u8>>(&bytes).is_err());
    assert!(from_slice::<String>(&bytes).is_err());
    assert!(from_slice::<u64>(&[0xff; 20]).is_err());
    assert!(from_slice::<u8>(&[0x80, 0x02]).is_err(), "256 is no u8");
    assert!(from_slice::<u64>(&[2, 0]).is_err(), "trailing bytes");
    assert!(from_slice::<u64>(&[3]).is_err(), "a difference with no base");
    assert!(from_slice::<String>(&[5]).is_err(), "a reference to no string");
}
