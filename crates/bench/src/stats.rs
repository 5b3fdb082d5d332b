//! Summary statistics with NumPy's definitions, so that figures compare with
//! SGLang's `bench_serving` (which uses `np.mean`, `np.median`, `np.std` and
//! `np.percentile`) digit for digit.
//!
//! Invariants: inputs are not required to be sorted; NaN values are not
//! expected (latencies and lengths never are). An empty input gives `0.0`
//! except where a function says otherwise, matching SGLang's `np.mean(x or 0)`.

/// Arithmetic mean; `0.0` for an empty slice.
pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Population standard deviation (`np.std`, ddof 0); `0.0` for an empty slice.
pub fn std_dev(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / xs.len() as f64).sqrt()
}

/// The `p`-th percentile (0 to 100) with linear interpolation between the two
/// nearest ranks (`np.percentile`'s default); `0.0` for an empty slice.
pub fn percentile(xs: &[f64], p: f64) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    percentile_sorted(&v, p)
}

/// [`percentile`] of an already sorted slice.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> f64 {
    let n = sorted.len();
    if n == 0 {
        return 0.0;
    }
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (n - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    sorted[lo] + (sorted[hi.min(n - 1)] - sorted[lo]) * frac
}

/// Median (`np.median`, the 50th percentile with interpolation).
pub fn median(xs: &[f64]) -> f64 {
    percentile(xs, 50.0)
}

/// Largest value; `0.0` for an empty slice.
pub fn max(xs: &[f64]) -> f64 {
    xs.iter()
        .copied()
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))))
        .unwrap_or(0.0)
}

/// The seeds' `profile_workload.py` percentile: `sorted(xs)[int(len(xs) * q)]`
/// (nearest rank from below, no interpolation), clamped to the last element;
/// `None` for an empty slice.
pub fn nearest_rank(xs: &[usize], q: f64) -> Option<usize> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_unstable();
    let i = ((v.len() as f64 * q) as usize).min(v.len() - 1);
    Some(v[i])
}

/// The seeds' median (`statistics.median`): the middle value, or the mean of
/// the two middle values for an even count; `None` for an empty slice.
pub fn median_usize(xs: &[usize]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_unstable();
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2] as f64
    } else {
        (v[n / 2 - 1] as f64 + v[n / 2] as f64) / 2.0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn numpy_percentiles_on_known_inputs() {
        // np.percentile([1, 2, 3, 4], [0, 25, 50, 90, 99, 100])
        let xs = [4.0, 1.0, 3.0, 2.0];
        assert!(close(percentile(&xs, 0.0), 1.0));
        assert!(close(percentile(&xs, 25.0), 1.75));
        assert!(close(percentile(&xs, 50.0), 2.5));
        assert!(close(percentile(&xs, 90.0), 3.7));
        assert!(close(percentile(&xs, 99.0), 3.97));
        assert!(close(percentile(&xs, 100.0), 4.0));
        // np.percentile(range(1, 101), 95) == 95.05; np.percentile(range(1, 101), 99) == 99.01
        let r: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!(close(percentile(&r, 95.0), 95.05));
        assert!(close(percentile(&r, 99.0), 99.01));
        assert!(close(percentile(&r, 90.0), 90.1));
        assert!(close(median(&r), 50.5));
        assert!(close(percentile(&[7.0], 99.0), 7.0));
    }

    #[test]
    fn mean_std_max_and_empty_inputs() {
        let xs = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0];
        assert!(close(mean(&xs), 5.0));
        assert!(close(std_dev(&xs), 2.0));
        assert!(close(max(&xs), 9.0));
        assert_eq!(mean(&[]), 0.0);
        assert_eq!(std_dev(&[]), 0.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
        assert_eq!(max(&[]), 0.0);
    }

    #[test]
    fn seeds_definitions() {
        // statistics.median and sorted(x)[int(n * 0.95)] as in profile_workload.py.
        let xs: Vec<usize> = (1..=20).collect();
        assert_eq!(median_usize(&xs), Some(10.5));
        assert_eq!(nearest_rank(&xs, 0.95), Some(20));
        assert_eq!(median_usize(&[3, 1, 2]), Some(2.0));
        assert_eq!(nearest_rank(&[5, 1, 3], 0.95), Some(5));
        let hundred: Vec<usize> = (0..100).collect();
        assert_eq!(nearest_rank(&hundred, 0.95), Some(95));
        assert_eq!(median_usize(&[]), None);
        assert_eq!(nearest_rank(&[], 0.5), None);
    }
}
