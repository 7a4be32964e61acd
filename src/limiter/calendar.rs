//! Calendar months in a time zone, for `per: month` windows
//! ([`super::FixedWindow::calendar_month`]).
//!
//! A zone is a fixed offset from UTC (`+05:30`), or an IANA zone
//! (`Europe/Berlin`) by the rule the time-zone database states for it: the
//! POSIX TZ string that ends its TZif file (`CET-1CEST,M3.5.0,M10.5.0/3`:
//! UTC+1, UTC+2 from the last Sunday of March at 02:00 to the last Sunday
//! of October at 03:00), with the transitions the database lists past 2037
//! instead of a rule (Morocco's and Palestine's, which follow Ramadan)
//! applied before it. The table ([`zones`]) is generated from the
//! database by `make zones`; no database is read at run time.
//!
//! # When a month starts
//! Month `m` (months since January 1970) starts at the first instant whose
//! local time is at or past its 1st's midnight: where clocks skip midnight
//! (a change at 00:00 forward), at the skip; where they pass it twice (a
//! change back to before midnight), the first time. So every instant
//! belongs to exactly one month and month indices never go backwards as
//! time goes on (`month_of` is monotonic), whatever the zone does.
//! Rules describe the years from the database's last listed transition on;
//! the listed transitions are kept from 2026, so months before 2026 in a
//! zone whose rules changed since are placed by today's rule.
//! `tests/fixtures/zones/month-starts.txt` holds every zone's month starts
//! from 2026 to 2045 as Python's `zoneinfo` computes them from the TZif
//! files; the tests compare.

pub mod zones;

/// The largest fixed offset accepted, ±14 hours (UTC+14 is the farthest
/// there is).
pub const MAX_OFFSET_SECS: u32 = 14 * 3600;
const SECS_PER_DAY: i64 = 86_400;
const NANOS_PER_SEC: i128 = 1_000_000_000;
/// Transitions a rule makes within the window searched around a month's
/// start, at most: two a year over three years, and the listed ones.
const MAX_NEAR: usize = 16;
/// How far around a month's local midnight its start is searched: more
/// than any offset from UTC and any jump.
const NEAR_SECS: i64 = 30 * 3600;

/// One zone of the generated table ([`zones::ZONES`]).
pub struct TableZone {
    /// The IANA name.
    pub name: &'static str,
    /// Its rule's index in [`zones::RULES`].
    pub rule: u8,
    /// Transitions listed instead of a rule: UTC seconds and the offset
    /// east from then on, ascending.
    pub listed: &'static [(i64, i32)],
}

/// A time zone: an offset from UTC, or one that changes by a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Zone {
    /// The IANA name (`None`: a fixed offset).
    name: Option<&'static str>,
    rule: Rule,
    /// Transitions listed instead of a rule: UTC seconds and the offset
    /// east from then on, ascending; the rule applies from the last one.
    listed: &'static [(i64, i32)],
}

/// A POSIX TZ rule: standard time, and daylight saving time if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rule {
    /// Seconds east of UTC.
    std: i32,
    dst: Option<Dst>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dst {
    /// Seconds east of UTC.
    offset: i32,
    /// Local standard time it starts at; local daylight time it ends at.
    start: Change,
    end: Change,
}

/// A yearly change: a day and the local time (seconds after that day's
/// midnight, from -167 h to +167 h) in the offset in force before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Change {
    day: Day,
    time: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Day {
    /// `Jn`: day 1 to 365, February 29 never counted.
    Julian(u16),
    /// `n`: day 0 to 365, February 29 counted.
    Zero(u16),
    /// `Mm.w.d`: weekday `d` (0 Sunday) of week `w` (1 to 5, 5 the last)
    /// of month `m`.
    Weekday { month: u8, week: u8, day: u8 },
}

impl Zone {
    /// A zone `offset_secs` east of UTC, at most ±14 h.
    pub fn fixed(offset_secs: i32) -> Option<Zone> {
        (offset_secs.unsigned_abs() <= MAX_OFFSET_SECS).then_some(Zone {
            name: None,
            rule: Rule {
                std: offset_secs,
                dst: None,
            },
            listed: &[],
        })
    }

    /// The IANA zone `name` (case as the database spells it), if the
    /// table has it.
    pub fn named(name: &str) -> Option<Zone> {
        let i = zones::ZONES.binary_search_by(|z| z.name.cmp(name)).ok()?;
        let z = zones::ZONES.get(i)?;
        let rule = parse_rule(zones::RULES.get(usize::from(z.rule))?)?;
        Some(Zone {
            name: Some(z.name),
            rule,
            listed: z.listed,
        })
    }

    /// The IANA name, `None` for a fixed offset.
    pub fn name(&self) -> Option<&'static str> {
        self.name
    }

    /// The offset east of UTC if it never changes.
    pub fn fixed_offset(&self) -> Option<i32> {
        (self.rule.dst.is_none() && self.listed.is_empty()).then_some(self.rule.std)
    }

    /// A number that tells this zone's months from another's in a stored
    /// record's parameters (below 2^32): the offset plus 14 h for a fixed
    /// one, the table's index with bit 31 set for a named one.
    pub fn tag(&self) -> u32 {
        match self.name {
            None => self.rule.std.wrapping_add(MAX_OFFSET_SECS as i32) as u32,
            Some(name) => {
                let i = zones::ZONES.binary_search_by(|z| z.name.cmp(name)).unwrap_or(0);
                (1 << 31) | u32::try_from(i).unwrap_or(0)
            }
        }
    }

    /// The zone a [`Zone::tag`] names (of this build's table), if any.
    pub fn from_tag(tag: u32) -> Option<Zone> {
        if tag & (1 << 31) == 0 {
            return Zone::fixed(i32::try_from(tag).ok()?.checked_sub(MAX_OFFSET_SECS as i32)?);
        }
        let index = usize::try_from(tag & !(1 << 31)).ok()?;
        Zone::named(zones::ZONES.get(index)?.name)
    }

    /// Seconds east of UTC at `t` (UTC seconds).
    pub fn offset_at(&self, t: i64) -> i32 {
        if let (Some(&(first, _)), Some(&(last, _))) = (self.listed.first(), self.listed.last()) {
            if t >= first && t < last {
                let i = self.listed.partition_point(|&(at, _)| at <= t);
                if let Some(&(_, offset)) = self.listed.get(i.saturating_sub(1)) {
                    return offset;
                }
            }
        }
        self.rule.offset_at(t)
    }

    /// The months since January 1970 in this zone at `now` (ns since the
    /// epoch; 0 before).
    pub fn month_of(&self, now: u64) -> u64 {
        let t = i64::try_from(now / 1_000_000_000).unwrap_or(i64::MAX);
        let local = i128::from(t) + i128::from(self.offset_at(t));
        let (year, month) = civil_from_days(local.div_euclid(i128::from(SECS_PER_DAY)));
        let mut m = (year - 1970) * 12 + (month - 1);
        let t = i128::from(t);
        if self.fixed_offset().is_none() {
            if t < self.start_secs(m) {
                m -= 1;
            } else if t >= self.start_secs(m + 1) {
                m += 1;
            }
        }
        u64::try_from(m).unwrap_or(0)
    }

    /// The month of `now` in this zone: when it started and when it ends
    /// (ns since the epoch, UTC).
    pub fn month_at(&self, now: u64) -> Month {
        let index = self.month_of(now);
        Month {
            start: self.month_start(index),
            end: self.month_start(index.saturating_add(1)),
        }
    }

    /// The instant (ns since the epoch, UTC) month `index` starts.
    pub fn month_start(&self, index: u64) -> u128 {
        let secs = self.start_secs(i128::from(index));
        u128::try_from(secs.saturating_mul(NANOS_PER_SEC)).unwrap_or(0)
    }

    /// The UTC second month `index` (since January 1970) starts: the
    /// first whose local time is at or past its first midnight.
    fn start_secs(&self, index: i128) -> i128 {
        let (year, month) = (1970 + index.div_euclid(12), index.rem_euclid(12) + 1);
        let midnight = days_from_civil(year, month, 1).saturating_mul(i128::from(SECS_PER_DAY));
        if let Some(offset) = self.fixed_offset() {
            return midnight - i128::from(offset);
        }
        let Ok(local) = i64::try_from(midnight) else {
            return midnight;
        };
        // Local time is the instant plus the offset in force, so between
        // two transitions it reaches `local` at `local − offset`; the first
        // instant at or past it is such a point or a transition.
        let mut near = Near::default();
        self.transitions(
            local.saturating_sub(NEAR_SECS),
            local.saturating_add(NEAR_SECS),
            &mut near,
        );
        let mut first: Option<i64> = None;
        let mut consider = |c: i64| {
            if c.saturating_add(i64::from(self.offset_at(c))) >= local && first.is_none_or(|f| c < f) {
                first = Some(c);
            }
        };
        consider(local.saturating_sub(i64::from(self.offset_at(local.saturating_sub(NEAR_SECS)))));
        for &at in near.as_slice() {
            consider(at);
            consider(local.saturating_sub(i64::from(self.offset_at(at))));
        }
        first.map_or(midnight, i128::from)
    }

    /// The instants in `[from, to]` at which the offset may change.
    fn transitions(&self, from: i64, to: i64, near: &mut Near) {
        let i = self.listed.partition_point(|&(at, _)| at < from);
        for &(at, _) in self.listed.get(i..).unwrap_or_default() {
            if at > to {
                break;
            }
            near.push(at);
        }
        if let Some(dst) = self.rule.dst {
            let (year, _) = civil_from_days(i128::from(from.div_euclid(SECS_PER_DAY)));
            for y in year - 1..=year + 2 {
                for at in [dst.start.at(y, self.rule.std), dst.end.at(y, dst.offset)] {
                    if (from..=to).contains(&at) {
                        near.push(at);
                    }
                }
            }
        }
    }
}

/// A calendar month's first instant and the next month's (ns since the
/// epoch, UTC; unbounded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Month {
    pub start: u128,
    pub end: u128,
}

impl Month {
    /// Nanoseconds from `now` until the month ends.
    pub fn until_end(&self, now: u64) -> u64 {
        super::ns_until(self.end, now)
    }
}

/// A few instants, without allocating.
#[derive(Default)]
struct Near {
    at: [i64; MAX_NEAR],
    len: usize,
}

impl Near {
    fn push(&mut self, at: i64) {
        if let Some(slot) = self.at.get_mut(self.len) {
            *slot = at;
            self.len += 1;
        }
    }

    fn as_slice(&self) -> &[i64] {
        self.at.get(..self.len).unwrap_or_default()
    }
}

impl Rule {
    /// Seconds east of UTC at `t`: the offset the latest change at or
    /// before `t` set (standard time if none, or no daylight time).
    fn offset_at(&self, t: i64) -> i32 {
        let Some(dst) = self.dst else {
            return self.std;
        };
        let (year, _) = civil_from_days(i128::from(
            t.saturating_add(i64::from(self.std)).div_euclid(SECS_PER_DAY),
        ));
        let mut latest: Option<(i64, i32)> = None;
        for y in year - 1..=year + 1 {
            for (at, offset) in [
                (dst.start.at(y, self.std), dst.offset),
                (dst.end.at(y, dst.offset), self.std),
            ] {
                if at <= t && latest.is_none_or(|(l, _)| at > l) {
                    latest = Some((at, offset));
                }
            }
        }
        latest.map_or(self.std, |(_, offset)| offset)
    }
}

impl Change {
    /// The UTC second this change happens in `year`, where the offset in
    /// force before it is `before`.
    fn at(&self, year: i128, before: i32) -> i64 {
        let day = self.day.of(year);
        let local = day.saturating_mul(i128::from(SECS_PER_DAY)) + i128::from(self.time);
        i64::try_from(local - i128::from(before)).unwrap_or(i64::MAX)
    }
}

impl Day {
    /// Days since 1970-01-01 of this day in `year`.
    fn of(&self, year: i128) -> i128 {
        let jan1 = days_from_civil(year, 1, 1);
        match *self {
            Day::Julian(n) => {
                let leap = days_from_civil(year, 3, 1) - days_from_civil(year, 2, 1) == 29;
                jan1 + i128::from(n) - 1 + i128::from(leap && n >= 60)
            }
            Day::Zero(n) => jan1 + i128::from(n),
            Day::Weekday { month, week, day } => {
                let (month, week) = (i128::from(month), i128::from(week));
                let first = days_from_civil(year, month, 1);
                let next = days_from_civil(year + month / 12, month % 12 + 1, 1);
                // 1970-01-01 was a Thursday (4).
                let weekday = (first + 4).rem_euclid(7);
                let mut d = first + (i128::from(day) - weekday).rem_euclid(7) + 7 * (week - 1);
                while d >= next {
                    d -= 7;
                }
                d
            }
        }
    }
}

/// Parses a POSIX TZ rule (`std offset [dst [offset] [,start[/time],end[/time]]]`,
/// names alphabetic or `<…>`-quoted, offsets west of UTC as POSIX writes
/// them); `None` if it is not one.
fn parse_rule(text: &str) -> Option<Rule> {
    let mut p = Parser {
        rest: text.as_bytes(),
    };
    p.name()?;
    let std = p.offset()?.checked_neg()?;
    if p.rest.is_empty() {
        return Some(Rule { std, dst: None });
    }
    p.name()?;
    let offset = match p.rest.first() {
        Some(b',') | None => std.checked_add(3600)?,
        Some(_) => p.offset()?.checked_neg()?,
    };
    // POSIX leaves the dates out only where an implementation chooses
    // them; the database always writes them.
    p.eat(b',')?;
    let start = p.change()?;
    p.eat(b',')?;
    let end = p.change()?;
    p.rest.is_empty().then_some(Rule {
        std,
        dst: Some(Dst { offset, start, end }),
    })
}

struct Parser<'a> {
    rest: &'a [u8],
}

impl Parser<'_> {
    fn eat(&mut self, b: u8) -> Option<()> {
        let (&first, rest) = self.rest.split_first()?;
        (first == b).then(|| self.rest = rest)
    }

    fn name(&mut self) -> Option<()> {
        if self.eat(b'<').is_some() {
            let end = self.rest.iter().position(|&b| b == b'>')?;
            self.rest = self.rest.get(end + 1..)?;
            return Some(());
        }
        let len = self.rest.iter().take_while(|b| b.is_ascii_alphabetic()).count();
        self.rest = self.rest.get(len..)?;
        (len >= 3).then_some(())
    }

    fn number(&mut self) -> Option<i32> {
        let len = self.rest.iter().take_while(|b| b.is_ascii_digit()).count();
        let digits = self.rest.get(..len)?;
        self.rest = self.rest.get(len..)?;
        if len == 0 || len > 3 {
            return None;
        }
        std::str::from_utf8(digits).ok()?.parse().ok()
    }

    /// `[+-]hh[:mm[:ss]]` in seconds (hours up to 167, as RFC 8536 allows
    /// for times).
    fn offset(&mut self) -> Option<i32> {
        let sign = if self.eat(b'-').is_some() {
            -1
        } else {
            let _ = self.eat(b'+');
            1
        };
        let hours = self.number()?;
        let mut secs = hours.checked_mul(3600)?;
        for scale in [60, 1] {
            if self.eat(b':').is_none() {
                break;
            }
            secs = secs.checked_add(self.number()?.checked_mul(scale)?)?;
        }
        (hours <= 167).then_some(sign * secs)
    }

    fn change(&mut self) -> Option<Change> {
        let day = if self.eat(b'M').is_some() {
            let month = self.number()?;
            self.eat(b'.')?;
            let week = self.number()?;
            self.eat(b'.')?;
            let day = self.number()?;
            let ok = (1..=12).contains(&month) && (1..=5).contains(&week) && (0..=6).contains(&day);
            ok.then_some(Day::Weekday {
                month: u8::try_from(month).ok()?,
                week: u8::try_from(week).ok()?,
                day: u8::try_from(day).ok()?,
            })?
        } else if self.eat(b'J').is_some() {
            let n = self.number()?;
            (1..=365)
                .contains(&n)
                .then_some(Day::Julian(u16::try_from(n).ok()?))?
        } else {
            let n = self.number()?;
            (0..=365)
                .contains(&n)
                .then_some(Day::Zero(u16::try_from(n).ok()?))?
        };
        let time = if self.eat(b'/').is_some() {
            self.offset()?
        } else {
            2 * 3600
        };
        Some(Change { day, time })
    }
}

/// The proleptic Gregorian (year, month) of `days` since 1970-01-01
/// (Howard Hinnant's `civil_from_days`, exact for every day).
pub fn civil_from_days(days: i128) -> (i128, i128) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i128::from(month <= 2);
    (year, month)
}

/// Days since 1970-01-01 of `day` (1 to 31) of `month` in `year`
/// (Hinnant's `days_from_civil`).
pub fn days_from_civil(year: i128, month: i128, day: i128) -> i128 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests;
