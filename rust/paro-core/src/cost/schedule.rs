//! The step schedule: one training step's work in the order the engine issues it, and its simulation.
//!
//! Each micro-step runs the units' forwards in order, then their backwards in reverse, on the compute stream. A
//! unit's parameters are gathered before its forward and again before its backward; the engine prefetches the
//! next unit's gather while the current one computes, with at most two units unsharded (the gather of unit u+1
//! waits for the compute of unit u−1; [`IssuePolicy`], which the engine follows too). Where parameters are sharded,
//! the ranks agree after each forward on the units backward will gather (a small all-reduce of flags over all
//! ranks, on the gather lane, before backward's first gather). After a unit's backward
//! its gradients are reduced (g ≠ N); at the last micro-step t_syncg follows. The optimizer step waits for every
//! reduction and the boundary's small blocking all-reduces (the ranks' flags; with clipping, the gradients' norm),
//! and the next micro-step waits for its reductions (the engine's backward returns once they are done). t_syncp
//! of a unit runs right before its first gather of the next step, after the optimizer step, so it hides only
//! behind the forward of earlier units. Collectives queue on their level's links in issue order (an intra-group
//! and an inter-group call run at once; a global call holds both); compute waits only for what it needs.
//!
//! Where collectives and compute share a rank's cores (each level's `Link::overlap` and `Link::slowdown`), the
//! simulation runs them at rates: while compute runs, a collective progresses at
//! 1 / slowdown of its speed alone, and compute loses (1 − overlap) seconds per second of collective work done
//! beside it. With both figures 1 (GPUs; the default) every task runs at full speed. Where the ranks share CPU
//! cores (`Cluster::shared_cores`) the overlap is 0 on both levels: compute loses what the collectives do.

use serde::{Deserialize, Serialize};

use super::context::Context;
use super::traffic::Call;
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
    /// How much longer compute ran because collectives ran beside it (the rate model above); 0 when both
    /// overlaps are 1.
    #[serde(default)]
    pub interference_s: f64,
    /// The whole step, seconds.
    pub step_s: f64,
}

/// One piece of a step's work: compute (slot 0) or a collective on the intra links (1), the inter links (2) or both.
struct Task {
    slots: &'static [usize],
    /// Seconds alone.
    work: f64,
    deps: Vec<usize>,
    level: Option<Level>,
    /// A collective's: compute seconds lost per second of its work done beside compute (at most 1), and its
    /// slowdown there (alone it runs at full speed).
    cost: f64,
    slowdown: f64,
}

/// The compute stream and the two levels' links, each running its work in issue order; tasks are recorded as the
/// engine issues them and simulated at the end (`finish`).
#[derive(Default)]
struct Sim {
    tasks: Vec<Task>,
}

impl Sim {
    /// Records `seconds` of work on `slots`, to start once `deps` have finished; returns its index.
    fn run(&mut self, slots: &'static [usize], seconds: f64, deps: &[Option<usize>], level: Option<Level>) -> usize {
        let deps = deps.iter().flatten().copied().collect();
        self.tasks.push(Task { slots, work: seconds, deps, level, cost: 0.0, slowdown: 1.0 });
        self.tasks.len() - 1
    }

    fn compute(&mut self, seconds: f64, deps: &[Option<usize>]) -> usize {
        self.run(&[0], seconds, deps, None)
    }

    /// Records a collective at `level`: on its level's links, a global one on both.
    fn collective(&mut self, level: Level, seconds: f64, deps: &[Option<usize>]) -> usize {
        let slots: &'static [usize] = match level {
            Level::Intra => &[1],
            Level::Inter => &[2],
            Level::Global => &[1, 2],
        };
        self.run(slots, seconds, deps, Some(level))
    }

    /// Runs every task: each slot takes its tasks in issue order, a task starts when it is first in each of its
    /// slots' queues and its dependencies have finished, and runs at the rates of the module's rate model. Returns
    /// the step's exposed communication by level and interference (in `StepTime`) and when the compute stream ends
    /// (infinite when a task's work is).
    fn finish(&self) -> (StepTime, f64) {
        let tasks = &self.tasks;
        let mut queues: [std::collections::VecDeque<usize>; 3] = Default::default();
        // what each task waits for: its dependencies and the task before it on each of its slots
        let mut blockers: Vec<Vec<usize>> = tasks.iter().map(|t| t.deps.clone()).collect();
        for (i, t) in tasks.iter().enumerate() {
            for &r in t.slots {
                blockers[i].extend(queues[r].back().copied());
                queues[r].push_back(i);
            }
        }
        let last_blocker = |i: usize, finish: &[f64]| -> Option<usize> {
            blockers[i].iter().copied().max_by(|&a, &b| finish[a].total_cmp(&finish[b]))
        };
        let mut finish = vec![f64::INFINITY; tasks.len()];
        let mut start = vec![f64::INFINITY; tasks.len()];
        let mut left: Vec<f64> = tasks.iter().map(|t| t.work).collect();
        let mut active: Vec<usize> = Vec::new();
        let mut time = StepTime::default();
        let (mut now, mut compute_free) = (0.0_f64, 0.0_f64);
        // each task's dependencies before this index have finished (they stay finished)
        let mut first_open = vec![0_usize; tasks.len()];
        loop {
            // start what may start; tasks with no work end at once, which may let others start
            let mut changed = true;
            while changed {
                changed = false;
                for r in 0..3 {
                    let Some(&i) = queues[r].front() else { continue };
                    let t = &tasks[i];
                    let at_front = t.slots.iter().all(|&q| queues[q].front() == Some(&i));
                    while first_open[i] < t.deps.len() && finish[t.deps[first_open[i]]] <= now {
                        first_open[i] += 1;
                    }
                    if active.contains(&i) || !at_front || first_open[i] < t.deps.len() {
                        continue;
                    }
                    if t.slots == [0] && now > compute_free {
                        // compute idled until its last dependency ended: the communication it waited on is
                        // exposed, back along the chain of what each task waited for last (a task's time to its
                        // level)
                        let (mut end, mut critical) = (now, last_blocker(i, &finish));
                        while let Some(d) = critical.filter(|_| end > compute_free) {
                            let from = start[d].max(compute_free);
                            let waited = end - from;
                            match tasks[d].level {
                                Some(Level::Intra) => time.exposed_intra_s += waited,
                                Some(Level::Inter) => time.exposed_inter_s += waited,
                                Some(Level::Global) => time.exposed_global_s += waited,
                                None => {}
                            }
                            (end, critical) = (from, last_blocker(d, &finish));
                        }
                    }
                    start[i] = now;
                    active.push(i);
                    changed = true;
                }
                for i in active.iter().copied().filter(|&i| left[i] <= 0.0).collect::<Vec<_>>() {
                    self.end(i, now, &mut finish, &mut queues, &mut active);
                    if tasks[i].slots == [0] {
                        compute_free = now;
                    }
                    changed = true;
                }
            }
            if active.is_empty() {
                break;
            }
            // rates while this set runs
            let computing = active.iter().any(|&i| tasks[i].slots == [0]);
            let rate = |i: usize| {
                let t = &tasks[i];
                if t.slots != [0] {
                    return if computing { 1.0 / t.slowdown } else { 1.0 };
                }
                let lost: f64 =
                    active.iter().filter(|&&c| tasks[c].slots != [0]).map(|&c| tasks[c].cost / tasks[c].slowdown).sum();
                (1.0 - lost).max(0.0)
            };
            let rates: Vec<f64> = active.iter().map(|&i| rate(i)).collect();
            let dt = active
                .iter()
                .zip(&rates)
                .filter(|(_, &r)| r > 0.0)
                .map(|(&i, &r)| left[i] / r)
                .fold(f64::INFINITY, f64::min);
            if !dt.is_finite() {
                return (time, f64::INFINITY); // a task of infinite work (a vanishing bandwidth or throughput)
            }
            now += dt;
            for (&i, &r) in active.iter().zip(&rates) {
                if tasks[i].slots == [0] {
                    time.interference_s += (1.0 - r) * dt; // the compute this interval did not do
                }
                if r > 0.0 && left[i] / r <= dt * (1.0 + 1e-12) {
                    left[i] = 0.0;
                } else {
                    left[i] -= r * dt;
                }
            }
        }
        debug_assert!(finish.iter().all(|f| f.is_finite()), "a task never started: a dependency cycle");
        (time, compute_free)
    }

    /// Ends task `i` at `now`: frees its slots for the next task in issue order.
    fn end(
        &self,
        i: usize,
        now: f64,
        finish: &mut [f64],
        queues: &mut [std::collections::VecDeque<usize>; 3],
        active: &mut Vec<usize>,
    ) {
        finish[i] = now;
        for &r in self.tasks[i].slots {
            queues[r].pop_front();
        }
        active.retain(|&a| a != i);
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
                let (intra, inter) = self.level_seconds(&c.traffic, false);
                let unpack = self.unpack_seconds(&c.traffic);
                let seconds = self.joined(c, intra, inter) + unpack; // call_seconds, from the parts
                let task = sim.collective(c.level, seconds, &[last, memory]);
                // a call on both levels (pipelined, in a row or, for a flat call, timed on the inter level alone):
                // its levels' slowdowns stretch their parts, and compute loses their overlaps' average by time;
                // the copy-out is local work, priced as the intra level's (unslowed)
                let cluster = &self.req.cluster;
                if seconds > 0.0 {
                    let (lost_intra, lost_inter) = if cluster.shared_cores {
                        (1.0, 1.0)
                    } else {
                        (1.0 - cluster.intra.overlap.unwrap_or(1.0), 1.0 - cluster.inter.overlap.unwrap_or(1.0))
                    };
                    let (slow_intra, slow_inter) = self.level_seconds(&c.traffic, true);
                    let t = &mut sim.tasks[task];
                    t.cost = (lost_intra * (intra + unpack) + lost_inter * inter) / (intra + inter + unpack);
                    t.slowdown = (self.joined(c, slow_intra, slow_inter) + unpack) / seconds;
                }
                last = Some(task);
            }
            last
        };
        let mut boundary = Vec::new();
        // the engine's backward returns once the micro-step's reductions are done: what follows waits for them
        let mut settled: Option<usize> = None;
        for micro in 0..accum {
            let sync_param = |u: usize| if micro == 0 { &calls[u].sync_param[..] } else { &[][..] };
            // forward: unit u+1's gather is issued before unit u computes, once the policy lets it hold memory
            let mut forward: Vec<usize> = Vec::with_capacity(units);
            let mut ready = {
                let synced = chain(&mut sim, sync_param(0), settled, None);
                chain(&mut sim, &calls[0].gather, synced, settled)
            };
            for u in 0..units {
                let next = if u + 1 < units {
                    let memory = policy.frees_memory_for(u + 1).map(|v| forward[v]).or(settled);
                    let synced = chain(&mut sim, sync_param(u + 1), settled, None);
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
            let mut reductions = Vec::new();
            // p = I, G: the ranks agree on the units backward will gather (a small all-reduce of flags over all
            // ranks on the gather lane, after the forward), and the last unit's gather for backward follows it
            let agreed = (s.p != Granularity::N)
                .then(|| sim.collective(Level::Global, self.small_all_reduce_seconds(Level::Global), &[last_forward]));
            let mut ready = chain(&mut sim, &calls[units - 1].gather, agreed, last_forward);
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
                }
                if tail != Some(done) {
                    reductions.push(tail);
                }
                ready = next;
            }
            if micro + 1 == accum {
                boundary = reductions;
            } else if !reductions.is_empty() {
                settled = Some(sim.compute(0.0, &reductions));
            }
        }
        // the boundary's small all-reduces, blocking, after every reduction: the ranks' flags (which gradients
        // exist, on the engine's world group) and, with clipping, the norm over the ranks that shard the os
        let mut last = sim.collective(Level::Global, self.small_all_reduce_seconds(Level::Global), &boundary);
        let norm_level = match s.os {
            Granularity::N => None,
            Granularity::I => Some(Level::Intra),
            Granularity::G => Some(Level::Global),
        };
        if let Some(level) = norm_level.filter(|_| self.req.training.clip_grad_norm) {
            last = sim.collective(level, self.small_all_reduce_seconds(level), &[Some(last)]);
        }
        let shard: u64 = self.sizes(s).iter().map(|&(tr, _)| tr).sum::<u64>() / self.degree(s.os);
        let optimizer_s = self.optimizer_seconds(shard);
        sim.compute(optimizer_s, &[Some(last)]);
        let (mut time, end) = sim.finish();
        time.optimizer_s = optimizer_s;
        time.compute_s = flops.iter().map(|f| self.compute_seconds(f.forward + f.backward)).sum::<f64>() * accum as f64;
        time.step_s = end;
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
