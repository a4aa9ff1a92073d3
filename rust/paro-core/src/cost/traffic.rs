//! Traffic per collective: the collectives each unit of a strategy runs in a training step (paper §3: the
//! parameter gathers and gradient reductions of every micro-step, t_syncg and t_syncp at the boundary) with the
//! bytes each rank sends and the ring steps it waits for on each level, and their sum over a step.

use serde::{Deserialize, Serialize};

use super::context::Context;
use super::request::CollectiveAlgorithm;
use crate::comm::{Collective, Level};
use crate::error::Result;
use crate::model::{checked_add, checked_mul};
use crate::strategy::{Granularity, Strategy};

/// When a collective runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Gathering a unit's parameters, before forward and again before backward, every micro-step.
    ParamGather,
    /// Reducing a unit's gradients after its backward, every micro-step.
    GradReduce,
    /// Bringing the accumulated gradients to the optimizer-state layout, once per step (t_syncg).
    SyncGrad,
    /// Rebuilding the parameter layout from the updated optimizer shards, once per step (t_syncp).
    SyncParam,
}

impl Phase {
    /// Calls per training step of a collective of this phase on one buffer, with `grad_accum` micro-steps.
    pub fn per_step(self, grad_accum: u64) -> u64 {
        match self {
            Phase::ParamGather => 2 * grad_accum,
            Phase::GradReduce => grad_accum,
            Phase::SyncGrad | Phase::SyncParam => 1,
        }
    }
}

/// The collectives of one kind that a strategy runs in one training step, summed over units.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectiveCost {
    /// When it runs.
    pub phase: Phase,
    /// What it does.
    pub op: Collective,
    /// Who takes part.
    pub level: Level,
    /// Calls per training step (buffers × repeats).
    pub count: u64,
    /// Sum over calls of the size of the full buffer the call covers (output of an all-gather, input of a
    /// reduce-scatter or all-reduce), bytes.
    pub payload_bytes: u64,
    /// Bytes each rank sends over intra-group links per step (rank average for a flat global ring).
    pub intra_bytes: u64,
    /// Bytes each rank sends over inter-group links per step (rank average for a flat global ring).
    pub inter_bytes: u64,
    /// Bytes each rank copies per step from the gathered buffers into the parameters' own storage (the engine's
    /// copy-out after a parameter gather; see `Traffic::unpacked`).
    #[serde(default)]
    pub unpacked_bytes: u64,
    /// Time of its calls per step, one after the other, seconds (see `time.rs`).
    pub time_s: f64,
}

/// One collective call of one unit: what the step schedule places.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Call {
    pub phase: Phase,
    pub op: Collective,
    pub level: Level,
    /// Size of the full buffer the call covers, bytes.
    pub payload: u64,
    pub traffic: Traffic,
}

/// Bytes and ring steps of one call (or, summed, of several).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Traffic {
    pub intra_bytes: u64,
    pub inter_bytes: u64,
    /// Ring steps paid at the intra latency α'.
    pub intra_hops: u64,
    /// Ring steps paid at the inter latency α.
    pub inter_hops: u64,
    /// Bytes that move at the intra bandwidth B'.
    pub timed_intra: u64,
    /// Bytes that move at the inter bandwidth B.
    pub timed_inter: u64,
    /// Bytes of reduce-scatters that move at the intra reduce-scatter bandwidth (B' unless measured apart).
    pub scattered_intra: u64,
    /// Bytes of reduce-scatters that move at the inter reduce-scatter bandwidth (B unless measured apart).
    pub scattered_inter: u64,
    /// Bytes of all-reduces that move at the inter all-reduce bandwidth (B unless measured apart). The engine's
    /// only large all-reduce is across groups (t_syncg with g = N, I and os = N, I).
    pub reduced_inter: u64,
    /// Bytes the rank copies out of a gathered parameter buffer (blocked layout) into the parameters' natural
    /// storage (the unshard's, re-grown after each reshard; at p = N t_syncp's, the parameters themselves): local
    /// work at the unpack bandwidth (`Cluster::unpack_bandwidth`), not traffic.
    pub unpacked: u64,
}

impl Traffic {
    pub fn plus(self, o: Traffic) -> Result<Traffic> {
        let w = "the bytes per step";
        Ok(Traffic {
            intra_bytes: checked_add(self.intra_bytes, o.intra_bytes, w)?,
            inter_bytes: checked_add(self.inter_bytes, o.inter_bytes, w)?,
            intra_hops: checked_add(self.intra_hops, o.intra_hops, w)?,
            inter_hops: checked_add(self.inter_hops, o.inter_hops, w)?,
            timed_intra: checked_add(self.timed_intra, o.timed_intra, w)?,
            timed_inter: checked_add(self.timed_inter, o.timed_inter, w)?,
            scattered_intra: checked_add(self.scattered_intra, o.scattered_intra, w)?,
            scattered_inter: checked_add(self.scattered_inter, o.scattered_inter, w)?,
            reduced_inter: checked_add(self.reduced_inter, o.reduced_inter, w)?,
            unpacked: checked_add(self.unpacked, o.unpacked, w)?,
        })
    }

    pub fn times(self, k: u64) -> Result<Traffic> {
        let w = "the bytes per step";
        Ok(Traffic {
            intra_bytes: checked_mul(self.intra_bytes, k, w)?,
            inter_bytes: checked_mul(self.inter_bytes, k, w)?,
            intra_hops: checked_mul(self.intra_hops, k, w)?,
            inter_hops: checked_mul(self.inter_hops, k, w)?,
            timed_intra: checked_mul(self.timed_intra, k, w)?,
            timed_inter: checked_mul(self.timed_inter, k, w)?,
            scattered_intra: checked_mul(self.scattered_intra, k, w)?,
            scattered_inter: checked_mul(self.scattered_inter, k, w)?,
            reduced_inter: checked_mul(self.reduced_inter, k, w)?,
            unpacked: checked_mul(self.unpacked, k, w)?,
        })
    }

    fn is_empty(&self) -> bool {
        *self == Traffic::default()
    }
}

/// Bytes each rank sends and ring steps of a ring collective over k ranks on a buffer of `x` bytes
/// (x divisible by k): all-gather and reduce-scatter (k−1)/k·x in k−1 steps, all-reduce twice that.
fn ring(op: Collective, k: u64, x: u64) -> Result<(u64, u64)> {
    if k <= 1 {
        return Ok((0, 0));
    }
    let w = "the bytes of a collective";
    let base = checked_mul(k - 1, x / k, w)?;
    match op {
        Collective::AllReduce => Ok((checked_mul(2, base, w)?, 2 * (k - 1))),
        _ => Ok((base, k - 1)),
    }
}

/// The calls of one unit in one step, by phase: `forward` before its forward (t_syncp, then the gather),
/// `backward` before its backward (the gather), `after` after its backward (the reduction, then t_syncg).
#[derive(Debug, Clone, Default)]
pub(super) struct UnitCalls {
    pub sync_param: Vec<Call>,
    pub gather: Vec<Call>,
    pub reduce: Vec<Call>,
    pub sync_grad: Vec<Call>,
}

impl Context<'_> {
    /// The calls of unit `u` under `s` (paper §3; the tables of `tests.rs` pin them).
    pub(super) fn unit_calls(&self, s: Strategy, u: usize) -> Result<UnitCalls> {
        use Granularity::{G, I, N};
        let t = &self.req.training;
        let w = "the bytes of a buffer";
        let level_of = |x: Granularity| if x == I { Level::Intra } else { Level::Global };
        let (tr, fr) = self.sizes(s)[u];
        let mut calls = UnitCalls::default();
        // Parameters: all-gather every buffer (trainable and frozen) before forward and before backward.
        if s.p != N {
            for numel in [tr, fr].into_iter().filter(|&x| x > 0) {
                let bytes = checked_mul(numel, t.param_bytes, w)?;
                // the gathered blocks are copied out into the unit's natural storage
                self.push(&mut calls.gather, Phase::ParamGather, Collective::AllGather, level_of(s.p), bytes, bytes)?;
            }
        }
        if tr == 0 {
            return Ok(calls);
        }
        let grad = checked_mul(tr, t.reduce_bytes.unwrap_or(t.grad_bytes), w)?;
        let param = checked_mul(tr, t.param_bytes, w)?;
        // Gradients: reduce-scatter every micro-step to the g layout.
        if s.g != N {
            self.push(&mut calls.reduce, Phase::GradReduce, Collective::ReduceScatter, level_of(s.g), grad, 0)?;
        }
        // t_syncg: accumulated gradients to the optimizer-state layout, by (g, os).
        let slice = grad / self.m;
        let (sg, ph) = (&mut calls.sync_grad, Phase::SyncGrad);
        match (s.g, s.os) {
            (N, N) => self.push(sg, ph, Collective::AllReduce, Level::Global, grad, 0)?,
            (N, I) => {
                self.push(sg, ph, Collective::ReduceScatter, Level::Intra, grad, 0)?;
                self.push(sg, ph, Collective::AllReduce, Level::Inter, slice, 0)?;
            }
            (N, G) => self.push(sg, ph, Collective::ReduceScatter, Level::Global, grad, 0)?,
            (I, I) => self.push(sg, ph, Collective::AllReduce, Level::Inter, slice, 0)?,
            (I, G) => self.push(sg, ph, Collective::ReduceScatter, Level::Inter, slice, 0)?,
            _ => {}
        }
        // t_syncp: updated trainable parameters back to the p layout, by (p, os).
        let (sp, ph) = (&mut calls.sync_param, Phase::SyncParam);
        // p = N keeps the natural layout: the gathered blocks are copied out; I gathers into its shard in place
        match (s.p, s.os) {
            (N, I) => self.push(sp, ph, Collective::AllGather, Level::Intra, param, param)?,
            (N, G) => self.push(sp, ph, Collective::AllGather, Level::Global, param, param)?,
            (I, G) => self.push(sp, ph, Collective::AllGather, Level::Inter, param / self.m, 0)?,
            _ => {}
        }
        Ok(calls)
    }

    /// The calls of a step summed into one row per (phase, op, level), in order of first use.
    pub(super) fn step_rows(&self, s: Strategy) -> Result<Vec<CollectiveCost>> {
        let a = self.req.training.grad_accum;
        let mut rows: Vec<CollectiveCost> = Vec::new();
        for u in 0..self.padded.len() {
            let calls = self.unit_calls(s, u)?;
            for c in [calls.gather, calls.reduce, calls.sync_grad, calls.sync_param].iter().flatten() {
                let count = c.phase.per_step(a);
                let traffic = c.traffic.times(count)?;
                let payload = checked_mul(c.payload, count, "the bytes per step")?;
                let time = self.call_seconds(c) * count as f64;
                match rows.iter_mut().find(|r| r.phase == c.phase && r.op == c.op && r.level == c.level) {
                    Some(r) => {
                        r.count = checked_add(r.count, count, "the calls per step")?;
                        r.payload_bytes = checked_add(r.payload_bytes, payload, "the bytes per step")?;
                        r.intra_bytes = checked_add(r.intra_bytes, traffic.intra_bytes, "the bytes per step")?;
                        r.inter_bytes = checked_add(r.inter_bytes, traffic.inter_bytes, "the bytes per step")?;
                        r.unpacked_bytes = checked_add(r.unpacked_bytes, traffic.unpacked, "the bytes per step")?;
                        r.time_s += time;
                    }
                    None => rows.push(CollectiveCost {
                        phase: c.phase,
                        op: c.op,
                        level: c.level,
                        count,
                        payload_bytes: payload,
                        intra_bytes: traffic.intra_bytes,
                        inter_bytes: traffic.inter_bytes,
                        unpacked_bytes: traffic.unpacked,
                        time_s: time,
                    }),
                }
            }
        }
        Ok(rows)
    }

    /// Adds a call on a buffer of `bytes` (a 1/m slice for the inter level) whose output the rank then copies out
    /// (`unpacked` bytes), unless it moves nothing (a level of one rank: the engine's local copy-out is then not
    /// counted either).
    fn push(
        &self,
        calls: &mut Vec<Call>,
        phase: Phase,
        op: Collective,
        level: Level,
        bytes: u64,
        unpacked: u64,
    ) -> Result<()> {
        let traffic = self.traffic(op, level, bytes)?;
        if !traffic.is_empty() {
            calls.push(Call { phase, op, level, payload: bytes, traffic: Traffic { unpacked, ..traffic } });
        }
        Ok(())
    }

    /// Bytes and ring steps of one call.
    fn traffic(&self, op: Collective, level: Level, x: u64) -> Result<Traffic> {
        // a reduce-scatter's bytes are timed at the level's reduce-scatter bandwidth, an inter all-reduce's at the
        // inter all-reduce bandwidth
        let intra = |op, x| -> Result<Traffic> {
            let (bytes, hops) = ring(op, self.m, x)?;
            let t = Traffic { intra_bytes: bytes, intra_hops: hops, ..Traffic::default() };
            Ok(match op {
                Collective::ReduceScatter => Traffic { scattered_intra: bytes, ..t },
                _ => Traffic { timed_intra: bytes, ..t },
            })
        };
        let inter = |op, x| -> Result<Traffic> {
            let (bytes, hops) = ring(op, self.g, x)?;
            let t = Traffic { inter_bytes: bytes, inter_hops: hops, ..Traffic::default() };
            Ok(match op {
                Collective::ReduceScatter => Traffic { scattered_inter: bytes, ..t },
                Collective::AllReduce => Traffic { reduced_inter: bytes, ..t },
                _ => Traffic { timed_inter: bytes, ..t },
            })
        };
        match level {
            Level::Intra => intra(op, x),
            Level::Inter => inter(op, x),
            Level::Global => match self.req.collectives {
                CollectiveAlgorithm::Hierarchical | CollectiveAlgorithm::Phased => {
                    let slice = x / self.m;
                    match op {
                        Collective::AllGather => {
                            inter(Collective::AllGather, slice)?.plus(intra(Collective::AllGather, x)?)
                        }
                        Collective::ReduceScatter => {
                            intra(Collective::ReduceScatter, x)?.plus(inter(Collective::ReduceScatter, slice)?)
                        }
                        _ => intra(Collective::ReduceScatter, x)?
                            .plus(inter(Collective::AllReduce, slice)?)?
                            .plus(intra(Collective::AllGather, x)?),
                    }
                }
                CollectiveAlgorithm::Flat => {
                    let (bytes, hops) = ring(op, self.n, x)?;
                    if self.g <= 1 {
                        return Ok(Traffic {
                            intra_bytes: bytes,
                            intra_hops: hops,
                            timed_intra: bytes,
                            ..Traffic::default()
                        });
                    }
                    // g of the n hops of the ring cross groups, and the slowest hop sets the pace of all. A
                    // group's m links carry its crossing together: NCCL runs m rings, one per rail, and on a
                    // link a group shares, the one rank that crosses has all of it. So the whole volume moves
                    // at m·B.
                    let crossing = (bytes as u128 * self.g as u128 / self.n as u128) as u64;
                    Ok(Traffic {
                        intra_bytes: bytes - crossing,
                        inter_bytes: crossing,
                        inter_hops: hops,
                        timed_inter: bytes.div_ceil(self.m),
                        ..Traffic::default()
                    })
                }
            },
        }
    }
}
