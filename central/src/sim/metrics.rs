//! What a run measured, from its per-tick series.

/// The most admitted in any window of `window_ticks` consecutive ticks.
pub fn max_window(admitted: &[u64], window_ticks: usize) -> u64 {
    let w = window_ticks.max(1);
    let mut sum: u64 = admitted.iter().take(w).sum();
    let mut best = sum;
    for i in w..admitted.len() {
        sum = sum + admitted[i] - admitted[i - w];
        best = best.max(sum);
    }
    best
}

/// The least admitted in any window of `window_ticks` consecutive ticks
/// that starts at or after tick `from` (`None`: no whole window fits).
pub fn min_window(admitted: &[u64], window_ticks: usize, from: usize) -> Option<u64> {
    let w = window_ticks.max(1);
    let tail = admitted.get(from..)?;
    if tail.len() < w {
        return None;
    }
    let mut sum: u64 = tail.iter().take(w).sum();
    let mut least = sum;
    for i in w..tail.len() {
        sum = sum + tail[i] - tail[i - w];
        least = least.min(sum);
    }
    Some(least)
}

/// Jain's fairness index of `x`: `(Σx)² / (n·Σx²)`, 1 when all are equal.
pub fn jain(x: &[u64]) -> f64 {
    let sum: f64 = x.iter().map(|&v| v as f64).sum();
    let squares: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
    if squares == 0.0 {
        1.0
    } else {
        sum * sum / (x.len() as f64 * squares)
    }
}

/// The lowest Jain's index of admissions among the nodes of one region,
/// over consecutive windows of `window_ticks` from tick `from`, counting
/// only regions of two nodes or more whose nodes admitted at least
/// `min_mean` units each on average in the window (`None`: no such
/// window). Nodes of one region get equal demand in every shape.
pub fn min_fairness(
    by_node: &[Vec<u64>],
    regions: &[usize],
    window_ticks: usize,
    from: usize,
    min_mean: f64,
) -> Option<f64> {
    let ticks = by_node.first().map_or(0, Vec::len);
    let w = window_ticks.max(1);
    let region_count = regions.iter().max().map_or(0, |r| r + 1);
    let mut least: Option<f64> = None;
    let mut start = from;
    while start + w <= ticks {
        for region in 0..region_count {
            let sums: Vec<u64> = by_node
                .iter()
                .zip(regions)
                .filter(|(_, r)| **r == region)
                .map(|(series, _)| series[start..start + w].iter().sum())
                .collect();
            let mean = sums.iter().sum::<u64>() as f64 / sums.len().max(1) as f64;
            if sums.len() >= 2 && mean >= min_mean {
                let j = jain(&sums);
                least = Some(least.map_or(j, |l: f64| l.min(j)));
            }
        }
        start += w;
    }
    least
}

/// Sums per consecutive `per` ticks (the last partial group dropped).
pub fn group(series: &[u64], per: usize) -> Vec<u64> {
    series.chunks_exact(per.max(1)).map(|c| c.iter().sum()).collect()
}

/// Admitted ÷ Σ min(demand, limit), per second, in %.
pub fn utilisation(admitted_s: &[u64], demand_s: &[u64], rate_per_s: f64) -> f64 {
    let wanted: f64 = demand_s.iter().map(|&d| (d as f64).min(rate_per_s)).sum();
    let got: u64 = admitted_s.iter().sum();
    if wanted == 0.0 {
        100.0
    } else {
        100.0 * got as f64 / wanted
    }
}

/// Seconds from each change until admissions, averaged over `smooth`
/// seconds, stay within `tolerance` of `min(demand, limit)` (averaged the
/// same way) for `hold` consecutive seconds; the worst over the changes,
/// `None` if one never settles before the run ends. Averaging hides the
/// per-second ripple of leases renewed once a second.
pub fn converge(
    admitted_s: &[u64],
    demand_s: &[u64],
    rate_per_s: f64,
    changes_s: &[f64],
    tolerance: f64,
    (smooth, hold): (usize, usize),
) -> Option<f64> {
    let smooth = smooth.max(1);
    let n = admitted_s.len().min(demand_s.len()).saturating_sub(smooth - 1);
    let avg = |j: usize| {
        let got: u64 = admitted_s[j..j + smooth].iter().sum();
        let want: f64 = demand_s[j..j + smooth]
            .iter()
            .map(|&d| (d as f64).min(rate_per_s))
            .sum();
        (got as f64, want)
    };
    let ok = |j: usize| {
        let (got, want) = avg(j);
        (got - want).abs() <= tolerance * want.max(1.0)
    };
    let hold = hold.max(1);
    let mut worst: f64 = 0.0;
    for &change in changes_s {
        let from = change.ceil() as usize;
        let settled = (from..n.saturating_sub(hold - 1)).find(|&s| (s..s + hold).all(ok))?;
        worst = worst.max(settled as f64 - change);
    }
    Some(worst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_max_window_slides_over_every_tick() {
        assert_eq!(max_window(&[1, 5, 1, 1, 5, 0], 3), 7);
        assert_eq!(max_window(&[4], 3), 4);
    }

    #[test]
    fn utilisation_counts_only_what_the_limit_allows() {
        // Demand 150 and 50 per second against 100/s: 150 wanted, 120 got.
        assert_eq!(utilisation(&[100, 20], &[150, 50], 100.0), 80.0);
    }

    #[test]
    fn convergence_is_the_worst_time_to_a_stable_target() {
        let adm = [10, 60, 98, 101, 100, 99, 100, 100];
        let dem = [200; 8];
        assert_eq!(converge(&adm, &dem, 100.0, &[0.0], 0.05, (1, 3)), Some(2.0));
        assert_eq!(converge(&adm, &dem, 100.0, &[0.0, 7.0], 0.05, (1, 3)), None);
        // A ripple of ±10% a second averages out over 2 s.
        let ripple = [90, 110, 90, 110, 90, 110, 90, 110];
        assert_eq!(converge(&ripple, &dem, 100.0, &[0.0], 0.05, (1, 3)), None);
        assert_eq!(converge(&ripple, &dem, 100.0, &[0.0], 0.05, (2, 3)), Some(0.0));
    }
}
