//! What every part of one estimate reads: the request, the topology's sizes and the model's units, padded.

use super::memory::{self, block_sizes};
use super::report::StrategyEstimate;
use super::request::Request;
use crate::error::Result;
use crate::model::{checked_add, checked_mul, Block, LlamaShape, Model};
use crate::strategy::{Granularity, Strategy};
use crate::topology::Topology;

/// Everything one strategy estimate needs.
pub(super) struct Context<'a> {
    /// Ranks n, group size m, groups g.
    pub(super) n: u64,
    pub(super) m: u64,
    pub(super) g: u64,
    pub(super) req: &'a Request,
    /// The units, in execution order.
    pub(super) blocks: Vec<Block>,
    /// The model's shape, when known (for its FLOPs).
    pub(super) shape: Option<LlamaShape>,
    /// Padded (trainable, frozen) element counts per unit, laid out at N, I and G.
    pub(super) padded: Vec<[(u64, u64); 3]>,
    pub(super) blocks_known: bool,
    pub(super) activations: u64,
}

impl<'a> Context<'a> {
    pub(super) fn new(topo: &Topology, req: &'a Request, model: &Model, activations: u64) -> Result<Self> {
        let n = topo.world as u64;
        let m = topo.group_size as u64;
        let padded = model.blocks.iter().map(|b| block_sizes(b, n, m)).collect::<Result<Vec<_>>>()?;
        // Checks once that the largest sums fit, so the per-strategy sums below cannot overflow.
        let total = padded.iter().flatten().try_fold(0u64, |acc, &(t, f)| {
            checked_add(acc, checked_add(t, f, "the padded parameter count")?, "the padded parameter count")
        })?;
        let widest = req.training.param_bytes.max(req.training.grad_bytes).max(req.training.optimizer_bytes).max(4);
        checked_mul(total, widest, "the memory of the model states")?;
        Ok(Context {
            n,
            m,
            g: topo.num_groups() as u64,
            req,
            blocks: model.blocks.clone(),
            shape: model.shape.clone(),
            padded,
            blocks_known: model.blocks_known,
            activations,
        })
    }

    pub(super) fn degree(&self, x: Granularity) -> u64 {
        x.degree(self.m as usize, self.n as usize) as u64
    }

    /// Padded (trainable, frozen) sizes per unit under `s`: the engine lays a trainable buffer out at os (its
    /// finest granularity) and a frozen one at p.
    pub(super) fn sizes(&self, s: Strategy) -> Vec<(u64, u64)> {
        self.padded.iter().map(|b| (b[memory::level_index(s.os)].0, b[memory::level_index(s.p)].1)).collect()
    }

    pub(super) fn estimate(&self, s: Strategy) -> Result<StrategyEstimate> {
        let memory = self.memory(s)?;
        let collectives = self.step_rows(s)?;
        let w = "the bytes per step";
        let (mut intra, mut inter, mut unpacked) = (0u64, 0u64, 0u64);
        for c in &collectives {
            intra = checked_add(intra, c.intra_bytes, w)?;
            inter = checked_add(inter, c.inter_bytes, w)?;
            unpacked = checked_add(unpacked, c.unpacked_bytes, w)?;
        }
        Ok(StrategyEstimate {
            strategy: s,
            code: s.code(),
            known_as: s.known_as().map(str::to_string),
            fits: memory.total <= self.req.cluster.memory_bytes,
            memory,
            intra_bytes: intra,
            inter_bytes: inter,
            unpacked_bytes: unpacked,
            time_s: collectives.iter().map(|c| c.time_s).sum(),
            step: self.step_time(s)?,
            collectives,
        })
    }
}
