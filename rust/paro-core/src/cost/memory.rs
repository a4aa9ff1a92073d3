//! Memory per rank of a strategy: model states by (p, g, os) (paper §3) and the transient buffers.

use serde::{Deserialize, Serialize};

use super::context::Context;
use crate::error::{ParoError, Result};
use crate::model::{checked_add, checked_mul, Block};
use crate::strategy::{Granularity, Strategy};

/// Memory per rank, bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    /// Parameter shards (trainable and frozen), sharded by p.
    pub params: u64,
    /// Gradient accumulation buffer of the trainable parameters, sharded by g.
    pub grads: u64,
    /// Optimizer states of the trainable parameters (K bytes each), sharded by os.
    pub optimizer_states: u64,
    /// `params + grads + optimizer_states` (paper §3).
    pub model_states: u64,
    /// Transient: gathered full parameters of the `prefetch` largest blocks (p ∈ {I, G}).
    pub gathered_params: u64,
    /// Transient: one full-size gradient of the largest block before it is reduced (g ∈ {I, G}).
    pub unsharded_grads: u64,
    /// Transient: the gradient of the optimizer shard in the masters' dtype at step time (when `grad_bytes` is less).
    pub fp32_grads: u64,
    /// Activations of one micro-batch (0 when the model has no shape).
    pub activations: u64,
    /// Sum of all of the above (a conservative peak).
    pub total: u64,
}

pub(super) fn level_index(x: Granularity) -> usize {
    match x {
        Granularity::N => 0,
        Granularity::I => 1,
        Granularity::G => 2,
    }
}

/// A block's padded (trainable, frozen) sizes at N, I and G: the engine's when given (checked), else each
/// buffer padded to a multiple of the world size.
pub(super) fn block_sizes(b: &Block, n: u64, m: u64) -> Result<[(u64, u64); 3]> {
    let Some(p) = b.padded else {
        let (t, f) = (padded_numel(b.trainable, n)?, padded_numel(b.frozen(), n)?);
        return Ok([(t, f); 3]);
    };
    let mut out = [(0, 0); 3];
    for (i, degree) in [1, m, n].into_iter().enumerate() {
        let (t, f) = (p.trainable[i], p.frozen[i]);
        if t < b.trainable || f < b.frozen() || t % degree != 0 || f % degree != 0 {
            return Err(ParoError::Invalid(format!(
                "padded sizes {p:?} do not fit a block of {} trainable and {} frozen parameters (each must be at \
                 least its count and divisible by 1, m = {m}, n = {n})",
                b.trainable,
                b.frozen()
            )));
        }
        out[i] = (t, f);
    }
    Ok(out)
}

/// A buffer of `numel` elements padded up to a multiple of the world size n: ⌈numel/n⌉·n.
pub(super) fn padded_numel(numel: u64, world: u64) -> Result<u64> {
    if world == 0 {
        return Err(ParoError::Topology("world size must be at least 1".into()));
    }
    checked_mul(numel.div_ceil(world), world, "a padded buffer size")
}

impl Context<'_> {
    /// Memory per rank of `s`.
    pub(super) fn memory(&self, s: Strategy) -> Result<Memory> {
        let t = &self.req.training;
        let w = "the memory per rank";
        let (dp, dg, dos) = (self.degree(s.p), self.degree(s.g), self.degree(s.os));
        let padded = self.sizes(s);
        let all: u64 = padded.iter().map(|&(tr, fr)| tr + fr).sum();
        let trainable: u64 = padded.iter().map(|&(tr, _)| tr).sum();
        // with p = N the parameters stay in their natural layout (unpadded: the N-level size)
        let held = if s.p == Granularity::N { self.padded.iter().map(|b| b[0].0 + b[0].1).sum() } else { all };
        let params = checked_mul(held / dp, t.param_bytes, w)?;
        let grads = checked_mul(trainable / dg, t.grad_bytes, w)?;
        // masters stored as the parameters are share their storage, except where p = N keeps the parameters in
        // their natural layout and os is sharded: then the masters are a copy of their own. Lower-precision
        // parameters have their masters apart, counted in optimizer_bytes.
        let master = t.master_bytes.unwrap_or(4);
        let separate = t.param_bytes >= master && s.p == Granularity::N && s.os != Granularity::N;
        let masters = if separate { master } else { 0 };
        let optimizer_states = checked_mul(trainable / dos, t.optimizer_bytes + masters, w)?;
        let model_states = checked_add(checked_add(params, grads, w)?, optimizer_states, w)?;
        let gathered_params = if s.p != Granularity::N && self.blocks_known {
            let mut sizes: Vec<u64> = padded.iter().map(|&(tr, fr)| tr + fr).collect();
            sizes.sort_unstable_by(|a, b| b.cmp(a));
            let held: u64 = sizes.iter().take(t.prefetch as usize).sum();
            checked_mul(held, t.param_bytes, w)?
        } else {
            0
        };
        let unsharded_grads = if s.g != Granularity::N && self.blocks_known {
            let largest = padded.iter().map(|&(tr, _)| tr).max().unwrap_or(0);
            checked_mul(largest, t.grad_bytes, w)?
        } else {
            0
        };
        let fp32_grads = if t.grad_bytes < master { checked_mul(trainable / dos, master, w)? } else { 0 };
        let total = [gathered_params, unsharded_grads, fp32_grads, self.activations]
            .iter()
            .try_fold(model_states, |acc, &x| checked_add(acc, x, w))?;
        Ok(Memory {
            params,
            grads,
            optimizer_states,
            model_states,
            gathered_params,
            unsharded_grads,
            fp32_grads,
            activations: self.activations,
            total,
        })
    }
}
