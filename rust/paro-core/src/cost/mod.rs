//! Cost model: memory per rank, traffic per collective and time per step of every PaRO strategy (paper §3), and
//! the `auto` choice. One job per module: `request` (what is asked, checked), `report` (the answer), `context`
//! (what one estimate reads, shared by the rest), `memory`, `traffic` (the collectives of a step and their bytes),
//! `time` (of a collective call, a unit's compute, the optimizer), `schedule` (the step as the engine runs it,
//! simulated), `choice` and `explain`. Bytes are exact integers (buffers are padded as the engine pads them);
//! times come from the link figures and the compute and optimizer throughputs of the request.

mod choice;
mod context;
mod explain;
mod memory;
mod presets;
mod report;
mod request;
mod schedule;
#[cfg(test)]
mod tests;
mod time;
mod traffic;

pub use memory::Memory;
pub use presets::{GpuPreset, GPU_PRESETS};
pub use report::{Choice, ModelSummary, Report, StrategyEstimate};
pub use request::{Cluster, CollectiveAlgorithm, Link, Request, Selection, Training, MAX_WORLD};
pub use schedule::{IssuePolicy, StepTime};
pub use traffic::{CollectiveCost, Phase};

use crate::error::{ParoError, Result};
use crate::topology::Topology;
use choice::choose;
use context::Context;
use explain::notes;
use request::{requested_strategies, validate_cluster, validate_selection, validate_training};

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
