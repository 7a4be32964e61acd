use super::*;

const S: u64 = 1_000_000_000;
/// The months `month-starts.txt` covers: January 2026 to December 2045.
const FIRST_MONTH: i128 = (2026 - 1970) * 12;
const MONTHS: i128 = 20 * 12;

fn utc_midnight(index: i128) -> i128 {
    days_from_civil(1970 + index / 12, index % 12 + 1, 1) * 86_400
}

#[test]
fn every_zone_of_the_table_has_a_rule_that_parses() {
    for z in zones::ZONES {
        let rule = zones::RULES.get(usize::from(z.rule));
        let zone = Zone::named(z.name).unwrap_or_else(|| panic!("{}: {rule:?}", z.name));
        assert_eq!(zone.name(), Some(z.name));
        assert!(z.listed.windows(2).all(|w| w[0].0 < w[1].0), "{}", z.name);
    }
    assert!(
        zones::ZONES.windows(2).all(|w| w[0].name < w[1].name),
        "sorted, for the binary search"
    );
    assert!(Zone::named("Europe/Berln").is_none());
    assert!(Zone::named("europe/berlin").is_none());
    assert_eq!(
        Zone::named("Asia/Kolkata").and_then(|z| z.fixed_offset()),
        Some(19_800)
    );
    assert_eq!(Zone::named("Europe/Berlin").and_then(|z| z.fixed_offset()), None);
}

/// Every zone's months from 2026 to 2045 start where Python's `zoneinfo`
/// (reading the TZif files, not this table) says: each start is in its
/// month and the nanosecond before it in the month before.
#[test]
fn every_zones_months_start_where_the_time_zone_database_says() {
    let golden = include_str!("../../../tests/fixtures/zones/month-starts.txt");
    let mut zones_checked = 0;
    for line in golden.lines().filter(|l| !l.starts_with('#')) {
        let (names, offsets) = line.split_once('\t').expect("names, a tab, offsets");
        let offsets: Vec<i128> = offsets.split(' ').map(|o| o.parse().expect("a number")).collect();
        assert_eq!(offsets.len() as i128, MONTHS);
        for name in names.split(' ') {
            let zone = Zone::named(name).unwrap_or_else(|| panic!("{name} is in the table"));
            for (k, offset) in offsets.iter().enumerate() {
                let index = FIRST_MONTH + k as i128;
                let start = utc_midnight(index) - offset;
                assert_eq!(zone.start_secs(index), start, "{name}, month {index}");
                let ns = u64::try_from(start).unwrap() * S;
                assert_eq!(zone.month_of(ns) as i128, index, "{name}, month {index}");
                assert_eq!(zone.month_of(ns - 1) as i128, index - 1, "{name}, month {index}");
                assert_eq!(zone.month_start(index as u64), u128::from(ns));
            }
            zones_checked += 1;
        }
    }
    assert_eq!(
        zones_checked,
        zones::ZONES.len(),
        "every zone of the table has its starts"
    );
}

#[test]
fn a_month_starts_at_the_first_instant_past_its_midnight_where_clocks_jump() {
    // Chile moves its clocks forward at 24:00 on the first Saturday of
    // September (M9.1.6/24): on 2029-09-01, a Saturday, midnight never
    // comes and September starts at the jump, 04:00 UTC (00:00 at −04).
    let santiago = Zone::named("America/Santiago").unwrap();
    let september_2029 = (2029 - 1970) * 12 + 8;
    assert_eq!(
        santiago.start_secs(september_2029),
        utc_midnight(september_2029) + 4 * 3600
    );
    // Berlin: a month of winter time starts at 23:00 UTC the day before,
    // one of summer time at 22:00.
    let berlin = Zone::named("Europe/Berlin").unwrap();
    let (jan, jul) = ((2027 - 1970) * 12, (2027 - 1970) * 12 + 6);
    assert_eq!(berlin.start_secs(jan), utc_midnight(jan) - 3600);
    assert_eq!(berlin.start_secs(jul), utc_midnight(jul) - 7200);
    // Sydney's summer is in January (+11), its winter in July (+10).
    let sydney = Zone::named("Australia/Sydney").unwrap();
    assert_eq!(sydney.start_secs(jan), utc_midnight(jan) - 11 * 3600);
    assert_eq!(sydney.start_secs(jul), utc_midnight(jul) - 10 * 3600);
}

#[test]
fn months_never_go_backwards_in_any_zone() {
    // Every 7,919 s (prime: all times of day) over 2026–2028, every
    // seventh zone of the table (the month starts above cover them all).
    let from = u64::try_from(utc_midnight(FIRST_MONTH)).unwrap();
    for z in zones::ZONES.iter().step_by(7) {
        let (name, zone) = (z.name, Zone::named(z.name).unwrap());
        let mut last = zone.month_of(from * S);
        let mut t = from;
        while t < from + 3 * 366 * 86_400 {
            let m = zone.month_of(t * S);
            assert!(m == last || m == last + 1, "{name} at {t}");
            last = m;
            t += 7_919;
        }
    }
}

#[test]
fn fixed_offsets_place_months_in_closed_form() {
    let ist = Zone::fixed(19_800).unwrap();
    let jan = (2027 - 1970) * 12;
    assert_eq!(ist.start_secs(jan), utc_midnight(jan) - 19_800);
    assert_eq!(ist.fixed_offset(), Some(19_800));
    assert_eq!(ist.name(), None);
    assert!(Zone::fixed(14 * 3600).is_some());
    assert!(Zone::fixed(-14 * 3600).is_some());
    assert!(Zone::fixed(14 * 3600 + 1).is_none());
    assert!(Zone::fixed(i32::MIN).is_none());
    // The tags of a fixed and a named zone never meet.
    assert!(Zone::fixed(14 * 3600).unwrap().tag() < 1 << 31);
    assert!(Zone::named("Africa/Abidjan").unwrap().tag() >= 1 << 31);
    assert_ne!(Zone::named("Europe/Berlin"), Zone::named("Europe/Paris"));
    // A tag names its zone again (the central service keeps the tag).
    for zone in [
        ist,
        Zone::fixed(-14 * 3600).unwrap(),
        Zone::named("America/Santiago").unwrap(),
    ] {
        assert_eq!(Zone::from_tag(zone.tag()), Some(zone));
    }
    assert_eq!(Zone::from_tag(u32::MAX), None);
    assert_eq!(Zone::from_tag(14 * 3600 * 2 + 1), None);
}

#[test]
fn rules_parse_as_posix_writes_them_and_nothing_else() {
    let r = parse_rule("IST-1GMT0,M10.5.0,M3.5.0/1").unwrap();
    assert_eq!(
        (r.std, r.dst.unwrap().offset),
        (3600, 0),
        "Ireland's negative DST"
    );
    let r = parse_rule("<-02>2<-01>,M3.5.0/-1,M10.5.0/0").unwrap();
    assert_eq!(r.dst.unwrap().start.time, -3600);
    let r = parse_rule("<+1245>-12:45<+1345>,M9.5.0/2:45,M4.1.0/3:45").unwrap();
    assert_eq!((r.std, r.dst.unwrap().offset), (45_900, 49_500));
    let r = parse_rule("EST5EDT,J60/2,300").unwrap();
    assert_eq!(r.dst.unwrap().start.day, Day::Julian(60));
    assert_eq!(r.dst.unwrap().end.day, Day::Zero(300));
    for bad in [
        "",
        "X",
        "CET",
        "CET-",
        "CET-1CEST",
        "CET-1CEST,M3.5.0",
        "CET-1CEST,M13.5.0,M10.5.0",
        "CET-1CEST,M3.6.0,M10.5.0",
        "CET-1CEST,M3.5.7,M10.5.0",
        "CET-1CEST,J0,J365",
        "CET-1CEST,366,0",
        "CET-168",
        "CET-1CEST,M3.5.0/9999,M10.5.0",
        "<CET-1",
        "CET-1CEST,M3.5.0,M10.5.0/3x",
        "CET-99999999999",
    ] {
        assert!(parse_rule(bad).is_none(), "{bad:?}");
    }
}

#[test]
fn the_first_of_march_follows_a_leap_day_in_julian_days() {
    // J60 is March 1 in every year; 59 (zero-based) is March 1 only in
    // common years.
    assert_eq!(Day::Julian(60).of(2028), days_from_civil(2028, 3, 1));
    assert_eq!(Day::Julian(60).of(2027), days_from_civil(2027, 3, 1));
    assert_eq!(Day::Zero(59).of(2027), days_from_civil(2027, 3, 1));
    assert_eq!(Day::Zero(59).of(2028), days_from_civil(2028, 2, 29));
    // The last Sunday of October 2026 is the 25th; the first Saturday of
    // September 2029 the 1st.
    let last_sunday = Day::Weekday {
        month: 10,
        week: 5,
        day: 0,
    };
    assert_eq!(last_sunday.of(2026), days_from_civil(2026, 10, 25));
    let first_saturday = Day::Weekday {
        month: 9,
        week: 1,
        day: 6,
    };
    assert_eq!(first_saturday.of(2029), days_from_civil(2029, 9, 1));
}

#[test]
fn instants_at_the_ends_of_time_never_trap() {
    for zone in [
        Zone::named("Asia/Gaza").unwrap(),
        Zone::named("America/Santiago").unwrap(),
        Zone::fixed(-50_400).unwrap(),
    ] {
        for t in [0, 1, u64::MAX - 1, u64::MAX] {
            let m = zone.month_of(t);
            let _ = zone.month_start(m);
            let _ = zone.month_start(m.saturating_add(1));
        }
        let _ = zone.month_start(u64::MAX);
        let _ = zone.offset_at(i64::MIN);
        let _ = zone.offset_at(i64::MAX);
    }
}
