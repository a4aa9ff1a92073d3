//! Cost model: memory per rank, traffic per collective and time per step of every PaRO strategy (paper §3), and
//! the `auto` choice. One job per module: `request` (what is asked, checked), `memory`, `traffic` (the
//! collectives of a step and their bytes), `time` (of a collective call, a unit's compute, the optimizer),
//! `schedule` (the step as the engine runs it, simulated), `choice` and `explain`. Bytes are exact integers
//! (buffers are padded as the engine pads them); times come from the link figures and the compute and optimizer
//! throughputs of the request.

mod choice;
mod explain;
mod memory;
mod presets;
mod request;
mod schedule;
#[cfg(test)]
mod tests;
mod time;
mod traffic;

use serde::{Deserialize, Serialize};

pub use memory::Memory;
pub use presets::{GpuPreset, GPU_PRESETS};
pub use request::{Cluster, CollectiveAlgorithm, Link, Request, Selection, Training, MAX_WORLD};
pub use schedule::{IssuePolicy, StepTime};
pub use traffic::{CollectiveCost, Phase};

use crate::error::{ParoError, Result};
use crate::model::{checked_add, checked_mul, Block, LlamaShape, Model};
use crate::strategy::{Granularity, Strategy};
use crate::topology::Topology;
use choice::choose;
use explain::notes;
use memory::block_sizes;
use request::{requested_strategies, validate_cluster, validate_selection, validate_training};

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

/// Parses a JSON [`Request`] and returns the JSON [`Report`].
pub fn estimate_json(request: &str) -> Result<String> {
    let req: Request = serde_json::from_str(request)
        .map_err(|e| ParoError::Json { what: "the cost-model request", msg: e.to_string() })?;
    let report = estimate(&req)?;
    serde_json::to_string(&report).map_err(|e| ParoError::Json { what: "the cost-model report", msg: e.to_string() })
}

/// Estimates memory, communication and step time of the requested strategies and picks one.
pub fn estimate(req: &Request) -> Result<Report> {
    let cluster = &req.cluster;
    if cluster.world > MAX_WORLD {
        return Err(ParoError::Topology(format!(
            "world size {} is larger than the {MAX_WORLD} ranks the cost model handles",
            cluster.world
        )));
    }
    let topo = Topology::new(cluster.world, cluster.group_size)?;
    validate_cluster(cluster)?;
    validate_training(&req.training)?;
    validate_selection(&req.selection)?;
    let strategies = requested_strategies(req.strategies.as_deref())?;
    let model = req.model.resolve(req.trainable)?;
    let activations = match &model.shape {
        Some(shape) => shape.activation_bytes(
            req.training.micro_batch,
            req.training.seq_len,
            req.training.activation_checkpointing,
        )?,
        None => 0,
    };
    let ctx = Context::new(&topo, req, &model, activations)?;
    let estimates = strategies.iter().map(|&s| ctx.estimate(s)).collect::<Result<Vec<_>>>()?;
    let (choice, reason) = choose(&estimates, cluster.memory_bytes, &req.selection, &req.training, &model);
    Ok(Report {
        model: ModelSummary {
            params: model.num_params(),
            trainable: model.num_trainable(),
            blocks: model.blocks.len(),
            largest_block: model.blocks.iter().map(|b| b.numel).max().unwrap_or(0),
            shape: model.shape.clone(),
        },
        world: topo.world,
        group_size: topo.group_size,
        groups: topo.num_groups(),
        grad_accum: req.training.grad_accum,
        collectives: req.collectives,
        memory_budget: cluster.memory_bytes,
        strategies: estimates,
        choice,
        reason,
        notes: notes(&model, cluster),
    })
}

/// Everything one strategy estimate needs.
struct Context<'a> {
    /// Ranks n, group size m, groups g.
    n: u64,
    m: u64,
    g: u64,
    req: &'a Request,
    /// The units, in execution order.
    blocks: Vec<Block>,
    /// The model's shape, when known (for its FLOPs).
    shape: Option<LlamaShape>,
    /// Padded (trainable, frozen) element counts per unit, laid out at N, I and G.
    padded: Vec<[(u64, u64); 3]>,
    blocks_known: bool,
    activations: u64,
}

impl<'a> Context<'a> {
    fn new(topo: &Topology, req: &'a Request, model: &Model, activations: u64) -> Result<Self> {
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

    fn degree(&self, x: Granularity) -> u64 {
        x.degree(self.m as usize, self.n as usize) as u64
    }

    /// Padded (trainable, frozen) sizes per unit under `s`: the engine lays a trainable buffer out at os (its
    /// finest granularity) and a frozen one at p.
    fn sizes(&self, s: Strategy) -> Vec<(u64, u64)> {
        self.padded.iter().map(|b| (b[memory::level_index(s.os)].0, b[memory::level_index(s.p)].1)).collect()
    }

    fn estimate(&self, s: Strategy) -> Result<StrategyEstimate> {
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
