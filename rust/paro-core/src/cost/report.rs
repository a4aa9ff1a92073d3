//! The answer of the cost model: a [`Report`] of one [`StrategyEstimate`] per strategy and the `auto` choice.

use serde::{Deserialize, Serialize};

use super::memory::Memory;
use super::request::CollectiveAlgorithm;
use super::schedule::StepTime;
use super::traffic::CollectiveCost;
use crate::model::LlamaShape;
use crate::strategy::Strategy;

/// The estimate for one strategy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StrategyEstimate {
    /// The strategy.
    pub strategy: Strategy,
    /// Its code, e.g. "IIG".
    pub code: String,
    /// Its well-known name, e.g. "zero3", if it has one.
    pub known_as: Option<String>,
    /// Memory per rank.
    pub memory: Memory,
    /// Whether `memory.total` fits in the budget.
    pub fits: bool,
    /// Bytes each rank sends over intra-group links per training step.
    pub intra_bytes: u64,
    /// Bytes each rank sends over inter-group links per training step.
    pub inter_bytes: u64,
    /// Bytes each rank copies out of gathered parameter buffers per training step (local work, not traffic).
    #[serde(default)]
    pub unpacked_bytes: u64,
    /// Communication time per training step if nothing overlapped: the sum of the collectives' times, seconds.
    pub time_s: f64,
    /// Predicted step time and its parts (the step schedule), seconds.
    pub step: StepTime,
    /// The collectives of one training step.
    pub collectives: Vec<CollectiveCost>,
}

/// What the model looks like after expansion to blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSummary {
    /// Total parameters Ψ.
    pub params: u64,
    /// Trainable parameters Ψ'.
    pub trainable: u64,
    /// Number of blocks (communication units).
    pub blocks: usize,
    /// Parameters of the largest block.
    pub largest_block: u64,
    /// The shape, when known.
    pub shape: Option<LlamaShape>,
}

/// The strategy `auto` picks and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// The strategy.
    pub strategy: Strategy,
    /// Its code.
    pub code: String,
    /// Its well-known name, if any.
    pub known_as: Option<String>,
    /// Why, in words.
    pub reason: String,
}

/// The answer to a [`Request`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The model as blocks.
    pub model: ModelSummary,
    /// Number of ranks n.
    pub world: usize,
    /// Ranks per group m.
    pub group_size: usize,
    /// Number of groups g = n/m.
    pub groups: usize,
    /// Gradient-accumulation micro-steps per step, A.
    pub grad_accum: u64,
    /// How global collectives run.
    pub collectives: CollectiveAlgorithm,
    /// Memory budget per rank, bytes.
    pub memory_budget: u64,
    /// One estimate per requested strategy, in the order of [`Strategy::all_valid`].
    pub strategies: Vec<StrategyEstimate>,
    /// What `auto` picks; `None` when nothing fits.
    pub choice: Option<Choice>,
    /// Why `auto` picked `choice`, or why nothing fits.
    pub reason: String,
    /// Caveats of this estimate.
    pub notes: Vec<String>,
}
