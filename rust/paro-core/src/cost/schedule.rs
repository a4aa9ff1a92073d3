//! The step schedule: one training step's work in the order the engine issues it, and its simulation.
//!
//! Each micro-step runs the units' forwards in order, then their backwards in reverse, on the compute stream. A
//! unit's parameters are gathered before its forward and again before its backward; the engine prefetches the
//! next unit's gather while the current one computes, with at most two units unsharded (the gather of unit u+1
//! waits for the compute of unit u−1; [`IssuePolicy`], which the engine follows too). After a unit's backward
//! its gradients are reduced (g ≠ N); at the last micro-step t_syncg follows. The optimizer step waits for every reduction. t_syncp of a unit runs right
//! before its first gather of the next step, after the optimizer step, so it hides only behind the forward of
//! earlier units. Collectives queue on their level's links in issue order (an intra-group and an inter-group
//! call run at once; a global call holds both); compute waits only for what it needs.

use serde::{Deserialize, Serialize};

use super::traffic::Call;
use super::Context;
use crate::comm::Level;
use crate::error::Result;
use crate::strategy::{Granularity, Strategy};

/// When the engine issues a unit's parameter gather, relative to the unit computing now. The one statement of the
/// rule: the engine (`ParoShardedModule`, through `Strategy.gather_ahead`) issues by it and [`Context::step_time`]
/// simulates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IssuePolicy {
    /// How many units past the one computing may have their gathers issued (so at most `1 + gather_ahead` units
    /// are unsharded at once); `None`: every unit's at the start of the pass, which only p = N does, where nothing
    /// is gathered and t_syncp writes the parameters in place.
    pub gather_ahead: Option<usize>,
}

impl IssuePolicy {
    /// The engine's rule for `s`: one unit ahead where parameters are sharded, all at once where they are not.
    pub fn of(s: Strategy) -> IssuePolicy {
        IssuePolicy { gather_ahead: if s.p == Granularity::N { None } else { Some(1) } }
    }

    /// Where in a pass (forward or backward, positions in its order) the unit is whose compute must end before
    /// the gather of the unit at position `next` may start: `next - 1 - gather_ahead`, or none.
    fn frees_memory_for(self, next: usize) -> Option<usize> {
        self.gather_ahead.and_then(|a| next.checked_sub(a + 1))
    }
}

/// Predicted time of one training step and its parts; `step_s` is the sum of the others.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// Forward and backward (with recomputation) of every micro-step, seconds.
    pub compute_s: f64,
    /// The optimizer step on this rank's os shard, seconds.
    pub optimizer_s: f64,
    /// Communication that compute waits for, by the level of the collective it waits on, seconds.
    pub exposed_intra_s: f64,
    /// See `exposed_intra_s`.
    pub exposed_inter_s: f64,
    /// See `exposed_intra_s` (global collectives use both levels' links).
    pub exposed_global_s: f64,
    /// What communication running beside compute costs compute: the share of communication time compute did not
    /// wait for, times each level's time weighted by (1 − that level's overlap); 0 when both overlaps are 1.
    #[serde(default)]
    pub interference_s: f64,
    /// The whole step, seconds.
    pub step_s: f64,
}

/// The compute stream and the two levels' links, each running its work in issue order.
#[derive(Default)]
struct Sim {
    finish: Vec<f64>,
    level: Vec<Option<Level>>,
    /// When the compute stream, the intra links and the inter links are next free.
    free: [f64; 3],
    time: StepTime,
    /// Seconds of every collective run, summed.
    communication_s: f64,
    /// The same, each level's part weighted by (1 − its overlap): what the collectives would take from compute if
    /// they all ran beside it.
    interference_s: f64,
}

impl Sim {
    /// Runs `seconds` of work on `slots` once `deps` have finished; returns its index.
    fn run(&mut self, slots: &[usize], seconds: f64, deps: &[Option<usize>], level: Option<Level>) -> usize {
        let deps: Vec<usize> = deps.iter().flatten().copied().collect();
        let ready = deps.iter().map(|&d| self.finish[d]).fold(0.0, f64::max);
        let free = slots.iter().map(|&r| self.free[r]).fold(0.0, f64::max);
        let start = ready.max(free);
        if slots == [0] && ready > free {
            // compute idles until its last dependency ends: the communication it waited on is exposed
            let critical = deps.iter().copied().max_by(|&a, &b| self.finish[a].total_cmp(&self.finish[b]));
            let waited = ready - free;
            match critical.and_then(|d| self.level[d]) {
                Some(Level::Intra) => self.time.exposed_intra_s += waited,
                Some(Level::Inter) => self.time.exposed_inter_s += waited,
                Some(Level::Global) => self.time.exposed_global_s += waited,
                None => {}
            }
        }
        let end = start + seconds;
        for &r in slots {
            self.free[r] = end;
        }
        self.finish.push(end);
        self.level.push(level);
        self.finish.len() - 1
    }

    fn compute(&mut self, seconds: f64, deps: &[Option<usize>]) -> usize {
        self.run(&[0], seconds, deps, None)
    }
}

impl Context<'_> {
    /// Simulates one step of `s` (steady state: the step starts right after the previous optimizer step).
    pub(super) fn step_time(&self, s: Strategy) -> Result<StepTime> {
        let units = self.blocks.len();
        let calls = (0..units).map(|u| self.unit_calls(s, u)).collect::<Result<Vec<_>>>()?;
        let flops: Vec<_> = (0..units).map(|u| self.unit_flops(u)).collect();
        let accum = self.req.training.grad_accum as usize;
        let policy = IssuePolicy::of(s);
        let mut sim = Sim::default();
        // issues `list` one after another after `first`; returns the last (or `first` when empty)
        let chain = |sim: &mut Sim, list: &[Call], first: Option<usize>, memory: Option<usize>| {
            let mut last = first;
            for c in list {
                let slots: &[usize] = match c.level {
                    Level::Intra => &[1],
                    Level::Inter => &[2],
                    Level::Global => &[1, 2],
                };
                let seconds = self.call_seconds(c);
                last = Some(sim.run(slots, seconds, &[last, memory], Some(c.level)));
                sim.communication_s += seconds;
                let (intra, inter) = self.level_seconds(&c.traffic);
                let cluster = &self.req.cluster;
                sim.interference_s += (1.0 - cluster.intra_overlap.unwrap_or(1.0)) * intra
                    + (1.0 - cluster.inter_overlap.unwrap_or(1.0)) * inter;
            }
            last
        };
        let mut boundary = Vec::new();
        for micro in 0..accum {
            let sync_param = |u: usize| if micro == 0 { &calls[u].sync_param[..] } else { &[][..] };
            // forward: unit u+1's gather is issued before unit u computes, once the policy lets it hold memory
            let mut forward: Vec<usize> = Vec::with_capacity(units);
            let mut ready = {
                let synced = chain(&mut sim, sync_param(0), None, None);
                chain(&mut sim, &calls[0].gather, synced, None)
            };
            for u in 0..units {
                let next = if u + 1 < units {
                    let memory = policy.frees_memory_for(u + 1).map(|v| forward[v]);
                    let synced = chain(&mut sim, sync_param(u + 1), None, None);
                    chain(&mut sim, &calls[u + 1].gather, synced, memory)
                } else {
                    None
                };
                forward.push(sim.compute(self.compute_seconds(flops[u].forward), &[ready]));
                ready = next;
            }
            // backward, in reverse; each unit's reductions (and t_syncg at the last micro-step) after it
            let last_forward = forward.last().copied();
            let mut backward: Vec<Option<usize>> = vec![None; units];
            let mut ready = chain(&mut sim, &calls[units - 1].gather, None, last_forward);
            for u in (0..units).rev() {
                let next = if u > 0 {
                    // the reverse pass's position of unit u-1 is units-u; the unit freeing memory for it, in
                    // the same pass, is units-1-v for position v
                    let memory =
                        policy.frees_memory_for(units - u).and_then(|v| backward[units - 1 - v]).or(last_forward);
                    chain(&mut sim, &calls[u - 1].gather, None, memory)
                } else {
                    None
                };
                let done = sim.compute(self.compute_seconds(flops[u].backward), &[ready, last_forward]);
                backward[u] = Some(done);
                let mut tail = chain(&mut sim, &calls[u].reduce, Some(done), None);
                if micro + 1 == accum {
                    tail = chain(&mut sim, &calls[u].sync_grad, tail, None);
                    boundary.push(tail);
                }
                ready = next;
            }
        }
        let shard: u64 = self.sizes(s).iter().map(|&(tr, _)| tr).sum::<u64>() / self.degree(s.os);
        let optimizer_s = self.optimizer_seconds(shard);
        sim.compute(optimizer_s, &boundary);
        let mut time = sim.time;
        time.optimizer_s = optimizer_s;
        time.compute_s = flops.iter().map(|f| self.compute_seconds(f.forward + f.backward)).sum::<f64>() * accum as f64;
        if time.compute_s > 0.0 && sim.communication_s > 0.0 {
            // only communication that ran beside compute slows it; without compute nothing did
            let exposed = time.exposed_intra_s + time.exposed_inter_s + time.exposed_global_s;
            let beside = (sim.communication_s - exposed).max(0.0) / sim.communication_s;
            time.interference_s = beside * sim.interference_s;
        }
        time.step_s = sim.free[0] + time.interference_s;
        Ok(time)
    }
}

#[cfg(test)]
mod tests {
    use super::IssuePolicy;
    use crate::strategy::Strategy;

    #[test]
    fn gathers_run_one_unit_ahead_where_parameters_are_sharded() {
        for s in Strategy::all_valid() {
            let policy = IssuePolicy::of(s);
            if s.code().starts_with('N') {
                assert_eq!(policy.gather_ahead, None, "{}", s.code());
                assert_eq!(policy.frees_memory_for(5), None);
            } else {
                assert_eq!(policy.gather_ahead, Some(1), "{}", s.code());
                // the gather at position 2 waits for position 0's compute: two units unsharded at most
                assert_eq!(
                    (0..4).map(|n| policy.frees_memory_for(n)).collect::<Vec<_>>(),
                    [None, None, Some(0), Some(1)]
                );
            }
        }
    }
}
