//! Adaptive speculation: how many draft tokens each request gets this step.
//!
//! Two measurements drive it. **Acceptance**: per request, decayed counts of
//! draft tokens accepted and tried (a token is tried when every draft before
//! it was accepted), so its per-token acceptance `a` estimates the chance
//! that the next draft token is accepted given the previous one was; a new
//! request starts from the engine-wide counts. **Step cost**: a least-squares
//! line `T(n) = fixed + per_token · n` over recent (tokens in step, seconds)
//! samples, decayed, so it follows the device from memory-bound (a small
//! batch: extra tokens nearly free) to compute-bound (a large batch: every
//! token costs).
//!
//! Decision: with `k` drafts a request expects `1 + a + a² + … + a^k` new
//! tokens. Starting from no drafts, the controller repeatedly grants the
//! draft token with the largest marginal gain `a^(k+1)` while that gain per
//! token of cost exceeds the step's current tokens per cost (the fractional
//! knapsack optimum, since gains fall with `k`). Until the cost line is
//! known (fewer than two distinct step sizes seen) and on every
//! `EXPLORE_EVERY`th step, drafts are granted in full so the measurements
//! stay current.
//!
//! Invariant: a grant never exceeds the draft the speculator proposed.

/// Decay applied to every cost sample and acceptance count per update.
const DECAY: f64 = 0.98;
/// One step in this many grants drafts in full (exploration).
const EXPLORE_EVERY: u64 = 32;
/// Prior acceptance (pseudo-counts) of a request that has drafted nothing yet.
const PRIOR_TRIES: f64 = 2.0;

/// Online fit of step time against tokens per step.
#[derive(Clone, Debug, Default)]
pub(crate) struct CostModel {
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    sizes: Vec<usize>,
}

impl CostModel {
    /// Records a step of `tokens` tokens that took `secs`.
    pub fn record(&mut self, tokens: usize, secs: f64) {
        let x = tokens as f64;
        self.w = self.w * DECAY + 1.0;
        self.sx = self.sx * DECAY + x;
        self.sy = self.sy * DECAY + secs;
        self.sxx = self.sxx * DECAY + x * x;
        self.sxy = self.sxy * DECAY + x * secs;
        if !self.sizes.contains(&tokens) && self.sizes.len() < 2 {
            self.sizes.push(tokens);
        }
    }

    /// (fixed, per_token) seconds, once two distinct step sizes were seen.
    pub fn line(&self) -> Option<(f64, f64)> {
        if self.sizes.len() < 2 || self.w <= 0.0 {
            return None;
        }
        let var = self.sxx * self.w - self.sx * self.sx;
        if var <= 1e-12 * self.w * self.w {
            return None;
        }
        let slope = ((self.sxy * self.w - self.sx * self.sy) / var).max(0.0);
        let fixed = ((self.sy - slope * self.sx) / self.w).max(1e-9);
        Some((fixed, slope))
    }
}

/// The engine-wide controller.
#[derive(Clone, Debug, Default)]
pub(crate) struct Adaptive {
    pub cost: CostModel,
    /// Engine-wide decayed (accepted, tried).
    global: (f64, f64),
    steps: u64,
}

/// Per-token acceptance estimate from decayed (accepted, tried) counts.
fn rate(own: (f64, f64), global: (f64, f64)) -> f64 {
    let prior = if global.1 > 0.0 {
        global.0 / global.1
    } else {
        0.5
    };
    ((own.0 + PRIOR_TRIES * prior) / (own.1 + PRIOR_TRIES)).clamp(0.0, 0.999)
}

impl Adaptive {
    /// Updates a request's and the engine's acceptance after a verify step of
    /// `drafted` tokens of which `accepted` were taken.
    pub fn observe(&mut self, own: &mut (f64, f64), drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let tried = (accepted + usize::from(accepted < drafted)) as f64;
        let acc = accepted as f64;
        *own = (own.0 * DECAY + acc, own.1 * DECAY + tried);
        self.global = (self.global.0 * DECAY + acc, self.global.1 * DECAY + tried);
    }

    /// Draft tokens to keep per request. `proposed[i]` is the length of request
    /// i's draft, `rates[i]` its (accepted, tried) counts, and `base_tokens`
    /// the tokens the step computes besides drafts.
    pub fn grant(
        &mut self,
        proposed: &[usize],
        rates: &[(f64, f64)],
        base_tokens: usize,
    ) -> Vec<usize> {
        self.steps += 1;
        let line = self.cost.line();
        let Some((fixed, per_token)) = line.filter(|_| !self.steps.is_multiple_of(EXPLORE_EVERY))
        else {
            return proposed.to_vec();
        };
        let a: Vec<f64> = rates.iter().map(|&r| rate(r, self.global)).collect();
        let mut k = vec![0usize; proposed.len()];
        let mut gain: f64 = proposed.len() as f64;
        let mut cost = fixed + per_token * base_tokens as f64;
        loop {
            // The next draft token with the largest marginal gain a^(k+1).
            let best = (0..k.len())
                .filter(|&i| k[i] < proposed[i])
                .map(|i| (i, a[i].powi(k[i] as i32 + 1)))
                .max_by(|x, y| x.1.total_cmp(&y.1));
            let Some((i, g)) = best else { break };
            // Worth it when tokens per second rise: (gain + g) / (cost + c) > gain / cost.
            if g * cost <= gain * per_token {
                break;
            }
            k[i] += 1;
            gain += g;
            cost += per_token;
        }
        k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_line_fits() {
        let mut c = CostModel::default();
        assert!(c.line().is_none());
        for n in [1usize, 4, 16, 64, 1, 4] {
            c.record(n, 0.01 + 0.001 * n as f64);
        }
        let (f, s) = c.line().expect("line");
        assert!(
            (f - 0.01).abs() < 1e-6 && (s - 0.001).abs() < 1e-7,
            "{f} {s}"
        );
    }

    #[test]
    fn grants_follow_acceptance_and_cost() {
        let mut a = Adaptive::default();
        // Until the cost is known, everything is granted.
        assert_eq!(a.grant(&[8, 3], &[(0.0, 0.0); 2], 2), vec![8, 3]);
        // Memory-bound: a step of 1 token costs as much as one of 64.
        for n in [1usize, 64, 1, 64] {
            a.cost.record(n, 0.01 + 1e-6 * n as f64);
        }
        let good = (90.0, 100.0);
        let bad = (1.0, 100.0);
        let g = a.grant(&[8, 8], &[good, bad], 2);
        assert_eq!(g[0], 8, "{g:?}");
        // Compute-bound: every token costs as much as the fixed part.
        let mut b = Adaptive::default();
        for n in [16usize, 64, 16, 64] {
            b.cost.record(n, 0.01 + 0.001 * n as f64);
        }
        let g = b.grant(&[8; 16], &[bad; 16], 16);
        assert!(g.iter().all(|&k| k == 0), "{g:?}");
        let g = b.grant(&[8; 16], &[good; 16], 16);
        assert!(g.iter().sum::<usize>() > 0, "{g:?}");
    }
}
