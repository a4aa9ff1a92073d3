//! Time of the parts of a step: a collective call (α–β per level; the two levels of a hierarchical call run
//! pipelined on chunks, as the paro backend runs them, those of a phased one in a row, as the engine issues them;
//! then the copy-out of a parameter gather into the parameters' storage at the unpack bandwidth),
//! a unit's forward and backward (FLOPs over the rank's throughput) and the optimizer step (the os shard over the
//! optimizer's throughput).

use super::context::Context;
use super::request::{CollectiveAlgorithm, Link};
use super::traffic::{Call, Traffic};
use crate::comm::{Collective, Level};
use crate::planner::ChunkPolicy;

/// FLOPs of one unit in one micro-step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct UnitFlops {
    pub forward: f64,
    /// Backward, with the recomputed forward when activations are checkpointed.
    pub backward: f64,
}

impl Context<'_> {
    /// Seconds of the intra-group and the inter-group part of some traffic, alone or (`beside_compute`) while
    /// compute runs on the rank: each level's slowdown stretches its part (an inter all-reduce's bytes at their own
    /// bandwidth), the reduce-scatter's slowdown its bytes.
    pub(super) fn level_seconds(&self, t: &Traffic, beside_compute: bool) -> (f64, f64) {
        let c = &self.req.cluster;
        let (intra, inter) = (&c.intra, &c.inter);
        // (the level's slowdown, its reduce-scatters') beside compute; 1 alone
        let slowdowns = |link: &Link| {
            let level = if beside_compute { link.slowdown.unwrap_or(1.0) } else { 1.0 };
            (level, if beside_compute { link.reduce_scatter_slowdown.unwrap_or(level) } else { 1.0 })
        };
        let scatter_bandwidth = |link: &Link| link.reduce_scatter_bandwidth.unwrap_or(link.bandwidth);
        let (intra_slowdown, intra_scatter) = slowdowns(intra);
        let (inter_slowdown, inter_scatter) = slowdowns(inter);
        let inter_reduce_bandwidth = inter.all_reduce_bandwidth.unwrap_or(inter.bandwidth);
        (
            intra_slowdown * (t.intra_hops as f64 * intra.latency + t.timed_intra as f64 / intra.bandwidth)
                + intra_scatter * t.scattered_intra as f64 / scatter_bandwidth(intra),
            inter_slowdown
                * (t.inter_hops as f64 * inter.latency
                    + t.timed_inter as f64 / inter.bandwidth
                    + t.reduced_inter as f64 / inter_reduce_bandwidth)
                + inter_scatter * t.scattered_inter as f64 / scatter_bandwidth(inter),
        )
    }

    /// Seconds of one call alone. A hierarchical global call cuts its per-rank message into the backend's chunks
    /// (`ChunkPolicy::count`) so that one level works on chunk k+1 while the other works on chunk k: the slower
    /// level's time plus one chunk of the faster one. A phased one takes both levels' times in a row.
    pub(super) fn call_seconds(&self, c: &Call) -> f64 {
        let (a, b) = self.level_seconds(&c.traffic, false);
        self.joined(c, a, b) + self.unpack_seconds(&c.traffic)
    }

    /// Seconds of the rank's copy-out after a gather (`Traffic::unpacked`), which follows the whole call; 0 when
    /// the request gives no unpack bandwidth.
    pub(super) fn unpack_seconds(&self, t: &Traffic) -> f64 {
        self.req.cluster.unpack_bandwidth.map_or(0.0, |rate| t.unpacked as f64 / rate)
    }

    /// Seconds of call `c` whose intra-group part takes `a` seconds and inter-group part `b` (see `call_seconds`).
    pub(super) fn joined(&self, c: &Call, a: f64, b: f64) -> f64 {
        if a == 0.0 || b == 0.0 || c.level != Level::Global || self.req.collectives == CollectiveAlgorithm::Phased {
            return a + b;
        }
        let per_rank = if c.op == Collective::AllReduce { c.payload } else { c.payload / self.n };
        let chunks = ChunkPolicy::default().count(per_rank) as f64;
        a.max(b) + a.min(b) / chunks
    }

    /// Seconds of a small all-reduce of the engine's (a few flags or a norm: latency only) within the groups
    /// (`Level::Intra`), across them, or over all ranks: its ring steps on each level, 2(k − 1) for k ranks.
    pub(super) fn small_all_reduce_seconds(&self, level: Level) -> f64 {
        let c = &self.req.cluster;
        let steps = |k: u64| 2.0 * k.saturating_sub(1) as f64;
        match level {
            Level::Intra => steps(self.m) * c.intra.latency,
            Level::Inter => steps(self.g) * c.inter.latency,
            Level::Global => steps(self.m) * c.intra.latency + steps(self.g) * c.inter.latency,
        }
    }

    /// Seconds of `flops` on this rank; 0 when the request gives no throughput.
    pub(super) fn compute_seconds(&self, flops: f64) -> f64 {
        self.req.cluster.compute_flops.map_or(0.0, |rate| flops / rate)
    }

    /// Seconds of the optimizer step on `params` parameters; 0 when the request gives no throughput.
    pub(super) fn optimizer_seconds(&self, params: u64) -> f64 {
        self.req.cluster.optimizer_params_per_s.map_or(0.0, |rate| params as f64 / rate)
    }

    /// FLOPs of unit `u` per micro-step: 2 per parameter and token forward; backward the same for the
    /// activation gradients plus 2 per trainable parameter and token for the weight gradients; attention
    /// 4·s·h per token and layer forward, twice that backward (Megatron-LM's count); with checkpointing the
    /// layers' forward once more in backward. A shaped model's embedding costs nothing; a model given as
    /// blocks counts every block as matrix products.
    pub(super) fn unit_flops(&self, u: usize) -> UnitFlops {
        let t = &self.req.training;
        let tokens = (t.micro_batch * t.seq_len) as f64;
        let b = &self.blocks[u];
        let (matmul, attention, recomputed) = match &self.shape {
            Some(_) if u == 0 => (0.0, 0.0, false),
            Some(shape) if u + 1 == self.blocks.len() => ((shape.vocab_size * shape.hidden_size) as f64, 0.0, false),
            Some(shape) => {
                let norms = 2 * shape.hidden_size;
                ((b.numel - norms) as f64, (4 * t.seq_len * shape.hidden_size) as f64, true)
            }
            None => (b.numel as f64, 0.0, true),
        };
        let trainable = if b.numel == 0 { 0.0 } else { b.trainable as f64 / b.numel as f64 };
        let forward = tokens * (2.0 * matmul + attention);
        let mut backward = tokens * (2.0 * matmul + 2.0 * trainable * matmul + 2.0 * attention);
        if t.activation_checkpointing && recomputed {
            backward += forward;
        }
        UnitFlops { forward, backward }
    }
}
