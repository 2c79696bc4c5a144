//! The page-headroom governor: with iteration marks, grow the page pool's headroom (`page_slack`) while
//! page moves cost more than `move_budget` of an iteration's wall time, up to `page_slack_max`.

use gen_vmm::PagePool;

/// Iteration marks that only start the move-budget clock.
const WARM_ITERATIONS: u64 = 3;

/// How much the page headroom grows at a time for an iteration that spent just over its move budget; up
/// to [`SLACK_STEPS_MAX`] times that when it spent that many budgets.
const SLACK_STEP: f64 = 0.005;
const SLACK_STEPS_MAX: f64 = 4.0;

/// The governor: its budget, its cap and the clock of the last iteration mark.
pub(crate) struct Headroom {
    move_budget: f64,
    slack_max: f64,
    clock: parking_lot::Mutex<IterationClock>,
}

#[derive(Default)]
struct IterationClock {
    marks: u64,
    last: Option<std::time::Instant>,
    move_ns: u64,
}

impl Headroom {
    /// A governor spending at most `move_budget` of an iteration on page moves, up to `slack_max`.
    pub fn new(move_budget: f64, slack_max: f64) -> Self {
        Headroom {
            move_budget,
            slack_max,
            clock: parking_lot::Mutex::new(IterationClock::default()),
        }
    }

    /// A training iteration ended: grow `pages`' headroom when the iteration spent more than the move
    /// budget of its wall time moving pages — by half a percent per budget spent, at most two percent at
    /// a time — and not while `plan_pending()` (a plan recorded, or ready to take the moves over). The
    /// first [`WARM_ITERATIONS`] marks only start the clock (warm-up lays everything out once).
    pub fn on_iteration(&self, pages: &PagePool, plan_pending: impl FnOnce() -> bool) {
        let now = std::time::Instant::now();
        let move_ns = pages.stats().move_ns;
        let mut it = self.clock.lock();
        it.marks += 1;
        if let Some(last) = it.last.filter(|_| it.marks > WARM_ITERATIONS) {
            let spent = move_ns.saturating_sub(it.move_ns) as f64;
            let elapsed = now.duration_since(last).as_nanos() as f64;
            let slack = pages.slack();
            let budget = self.move_budget * elapsed;
            // A plan being recorded, or ready and waiting for moves to prove it is needed, fixes them
            // itself (GPT-2: it activates a few iterations later and moves stop): headroom bought
            // meanwhile would be held for nothing.
            let plan_pending = plan_pending();
            if spent > budget && slack < self.slack_max && !plan_pending {
                let step = SLACK_STEP * (spent / budget).min(SLACK_STEPS_MAX);
                let grown = (slack + step).min(self.slack_max);
                pages.set_slack(grown);
                log::debug!(
                    "genpool: page moves took {:.1} % of an iteration: page headroom {:.3} -> {grown:.3}",
                    100.0 * spent / elapsed,
                    slack
                );
            }
        }
        it.last = Some(now);
        it.move_ns = move_ns;
    }
}
