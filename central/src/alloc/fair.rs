//! Max-min fair division of an integer budget, with floors and caps.
//!
//! Three passes, each a water-filling (every claimant gets the same amount,
//! except those that need less, who get what they need):
//! 1. **floors**: each claimant gets up to `min(floor, cap)`, so an idle node
//!    or region can start. If the floors do not fit, they are shared
//!    max-min fairly.
//! 2. **demand**: what is left goes toward `min(demand, cap)`.
//! 3. **headroom**: what is still left goes toward `cap`, evenly, so demand
//!    that grows before the next interval finds room.
//!
//! The result never exceeds the budget in total nor any claimant's cap.
//! Units that cannot be split evenly go to the lowest indices, so the
//! result is deterministic.

/// One claimant's floor, demand and cap, all in units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    pub floor: u64,
    pub demand: u64,
    pub cap: u64,
}

/// Splits `budget` among `claims` (see the module header).
pub fn max_min_fair(budget: u64, claims: &[Claim]) -> Vec<u64> {
    let mut alloc = vec![0u64; claims.len()];
    let mut left = budget;
    let passes: [&dyn Fn(&Claim) -> u64; 3] = [&|c| c.floor.min(c.cap), &|c| c.demand.min(c.cap), &|c| c.cap];
    for target in passes {
        let wants: Vec<u64> = claims
            .iter()
            .zip(&alloc)
            .map(|(c, a)| target(c).saturating_sub(*a))
            .collect();
        for (a, add) in alloc.iter_mut().zip(water_fill(left, &wants)) {
            *a += add;
            left -= add;
        }
    }
    alloc
}

/// Gives each `wants[i]` at most the common level that spends `budget`.
fn water_fill(budget: u64, wants: &[u64]) -> Vec<u64> {
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| (wants[i], i));
    let mut give = vec![0u64; wants.len()];
    let mut left = budget;
    for (pos, &i) in order.iter().enumerate() {
        let rest = (order.len() - pos) as u64;
        let level = left / rest;
        if wants[i] <= level {
            give[i] = wants[i];
            left -= wants[i];
            continue;
        }
        // Everyone from here on wants more than the level: all get it, and
        // the indivisible remainder goes one unit each to the lowest indices.
        let mut unsatisfied: Vec<usize> = order[pos..].to_vec();
        unsatisfied.sort_unstable();
        let mut extra = left - level * rest;
        for j in unsatisfied {
            let bonus = u64::from(extra > 0 && wants[j] > level);
            give[j] = level + bonus;
            extra -= bonus;
        }
        break;
    }
    give
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(floor: u64, demand: u64, cap: u64) -> Claim {
        Claim { floor, demand, cap }
    }

    #[test]
    fn demand_above_the_budget_is_split_max_min() {
        // 100 among demands 10, 50, 200: 10 is met, the others share 90.
        let a = max_min_fair(
            100,
            &[
                claim(0, 10, u64::MAX),
                claim(0, 50, u64::MAX),
                claim(0, 200, u64::MAX),
            ],
        );
        assert_eq!(a, vec![10, 45, 45]);
    }

    #[test]
    fn floors_come_first_so_an_idle_claimant_can_start() {
        let a = max_min_fair(100, &[claim(5, 0, u64::MAX), claim(5, 1000, u64::MAX)]);
        assert_eq!(a, vec![5, 95]);
        // Floors that do not fit are shared evenly.
        assert_eq!(max_min_fair(7, &[claim(5, 0, 9), claim(5, 9, 9)]), vec![4, 3]);
    }

    #[test]
    fn leftover_is_spread_as_headroom_up_to_the_caps() {
        let a = max_min_fair(100, &[claim(0, 10, 30), claim(0, 20, u64::MAX)]);
        assert_eq!(a, vec![30, 70]);
        let capped = max_min_fair(100, &[claim(0, 10, 30), claim(0, 20, 40)]);
        assert_eq!(capped, vec![30, 40]);
    }

    #[test]
    fn the_total_never_exceeds_the_budget_and_is_deterministic() {
        let mut seed = 7u64;
        for _ in 0..500 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let n = (seed >> 60) as usize + 1;
            let claims: Vec<Claim> = (0..n)
                .map(|i| {
                    let x = seed.rotate_left(i as u32 * 7);
                    claim(x % 7, x % 113, if x % 3 == 0 { x % 50 } else { u64::MAX })
                })
                .collect();
            let budget = seed % 300;
            let a = max_min_fair(budget, &claims);
            assert!(a.iter().sum::<u64>() <= budget);
            assert!(a.iter().zip(&claims).all(|(a, c)| *a <= c.cap));
            assert_eq!(a, max_min_fair(budget, &claims));
        }
    }
}
