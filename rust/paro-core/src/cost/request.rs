//! What the cost model is asked: the model, the cluster, how it is trained; and the checks on it.

use serde::{Deserialize, Serialize};

use crate::error::{ParoError, Result};
use crate::model::{ModelSpec, Trainable};
use crate::strategy::Strategy;

/// Largest world size the cost model accepts.
pub const MAX_WORLD: usize = 1 << 20;

/// What to estimate: a model, a cluster, how it is trained and which collectives run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// The model: exactly one of `preset`, `shape`, `params` (with optional `num_blocks`) or `blocks`.
    pub model: ModelSpec,
    /// How many parameters are trainable (`{"fraction": f}` or `{"count": c}`); all if absent. Not with `blocks`.
    #[serde(default)]
    pub trainable: Option<Trainable>,
    /// The machines.
    pub cluster: Cluster,
    /// Batch, precision and buffering settings.
    #[serde(default)]
    pub training: Training,
    /// How global (all-rank) collectives run.
    #[serde(default)]
    pub collectives: CollectiveAlgorithm,
    /// Strategies to estimate (codes such as "IIG" or aliases such as "zero3"); all 14 valid ones if absent.
    #[serde(default)]
    pub strategies: Option<Vec<String>>,
    /// Tolerances of the `auto` choice.
    #[serde(default)]
    pub selection: Selection,
}

/// The data-parallel cluster, per rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// Number of ranks n.
    pub world: usize,
    /// Ranks per group m (fast-linked, e.g. GPUs of a node); must divide `world`.
    pub group_size: usize,
    /// Intra-group bandwidth B', bytes per second per rank.
    pub intra_bandwidth: f64,
    /// Inter-group bandwidth B, bytes per second per rank (one rail per rank).
    pub inter_bandwidth: f64,
    /// Intra-group latency α' of one ring step, seconds.
    #[serde(default)]
    pub intra_latency: f64,
    /// Inter-group latency α of one ring step, seconds.
    #[serde(default)]
    pub inter_latency: f64,
    /// Memory budget per rank, bytes.
    pub memory_bytes: u64,
    /// Achieved training throughput of one rank, FLOP/s (a GPU's dense bf16 peak times its efficiency, or a
    /// measured probe). Without it compute is left out of the step time and nothing hides communication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_flops: Option<f64>,
    /// Parameters the optimizer updates per second on one rank (measured). Without it the step is free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_params_per_s: Option<f64>,
    /// How well compute runs beside intra-group communication, in [0, 1]: compute loses `1 - intra_overlap`
    /// seconds per second of the collective's work (its time alone) done beside it. 1 (the default) leaves compute
    /// as fast as alone (a GPU's copy engines and NVLink); 0 stops it while communication runs (collectives on the
    /// CPU cores the compute needs, e.g. Gloo over loopback). Measured by the probe (`paro_torch.auto`): a compute
    /// loop and an all-gather loop timed alone and at once. A call on both levels costs their average by time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intra_overlap: Option<f64>,
    /// See `intra_overlap`, for inter-group communication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_overlap: Option<f64>,
    /// How much slower an intra-group collective runs while compute runs beside it, at least 1 (the default: as
    /// fast as alone). Measured by the same probe as `intra_overlap`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intra_slowdown: Option<f64>,
    /// See `intra_slowdown`, for inter-group communication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_slowdown: Option<f64>,
    /// Intra-group bandwidth of a reduce-scatter, bytes per second per rank, where it differs from an
    /// all-gather's (`intra_bandwidth`, the default): on Gloo the engine runs it as an all-to-all and a local sum.
    /// Measured by the link probe on the engine's own reduce-scatter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intra_reduce_scatter_bandwidth: Option<f64>,
    /// See `intra_reduce_scatter_bandwidth`, for inter-group communication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_reduce_scatter_bandwidth: Option<f64>,
    /// Inter-group bandwidth of an all-reduce, bytes per second per rank (of the ring's 2(k − 1)/k of the buffer),
    /// where it differs from an all-gather's (`inter_bandwidth`, the default): the engine's t_syncg all-reduce
    /// across groups (g = N, I with os = N, I). Measured by the link probe on an all-reduce across groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_all_reduce_bandwidth: Option<f64>,
    /// How much slower an intra-group reduce-scatter runs beside compute, at least 1 (default `intra_slowdown`).
    /// Measured by the overlap probe with the engine's reduce-scatter in place of the all-gather.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intra_reduce_scatter_slowdown: Option<f64>,
    /// See `intra_reduce_scatter_slowdown`, for inter-group communication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_reduce_scatter_slowdown: Option<f64>,
    /// Bytes per second at which a rank copies a gathered parameter buffer out into the parameters' own storage
    /// (the engine's unshard re-grows the storage it freed at the last reshard, which on the CPU may fault its
    /// pages in again). Without it the copy-out is free. Measured by `paro_torch.auto.measure_unpack`: that
    /// copy-out with every rank copying at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpack_bandwidth: Option<f64>,
    /// Whether the ranks compute and run their collectives, on both levels, on the same CPU cores (CPU training;
    /// `paro_torch` sets it for CPU ranks). Then a collective's work done beside compute is compute's loss one for
    /// one, whatever `intra_overlap` and `inter_overlap` say (as if both were 0), and a collective runs at its speed
    /// alone while compute waits for it: the ranks run the same schedule, so the ranks that share its cores wait for
    /// it too. On the emulated cluster this fits the measured steps best (benchmarks/JOURNAL.md, "Shared cores:
    /// collectives take their work from compute").
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared_cores: bool,
}

/// How the model is trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Training {
    /// Gradient-accumulation micro-steps per optimizer step, A.
    pub grad_accum: u64,
    /// Sequences per micro-step per rank.
    pub micro_batch: u64,
    /// Tokens per sequence.
    pub seq_len: u64,
    /// Whether each decoder layer recomputes its activations in backward.
    pub activation_checkpointing: bool,
    /// Bytes per parameter element as stored and communicated (2 for bf16).
    pub param_bytes: u64,
    /// Bytes per gradient element as accumulated across micro-steps (2 for bf16).
    pub grad_bytes: u64,
    /// Bytes per gradient element in reductions; default `grad_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduce_bytes: Option<u64>,
    /// Optimizer-state bytes per trainable parameter, K (12: fp32 master + Adam m and v).
    pub optimizer_bytes: u64,
    /// Number of blocks whose gathered parameters are held at once (current + prefetched).
    pub prefetch: u64,
    /// Whether each step clips the gradients' global norm (`clip_grad_norm_`): one more small blocking
    /// all-reduce before the optimizer step, over the ranks that shard the optimizer states.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub clip_grad_norm: bool,
}

impl Default for Training {
    fn default() -> Self {
        Training {
            grad_accum: 1,
            micro_batch: 1,
            seq_len: 2048,
            activation_checkpointing: true,
            param_bytes: 2,
            grad_bytes: 2,
            reduce_bytes: None,
            optimizer_bytes: 12,
            prefetch: 2,
            clip_grad_norm: false,
        }
    }
}

/// How a collective over all n ranks runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveAlgorithm {
    /// One ring over all n ranks in rank order (plain NCCL). g of its n hops cross groups, so g/n of the bytes
    /// count as inter (a rank average, rounded down to whole bytes); its time is paced by the crossing hops,
    /// which a group's m links carry together (m·B).
    Flat,
    /// An intra-group and an inter-group phase (PaRO-CC, what the paro backend does), pipelined on chunks: one
    /// level works on a chunk while the other works on the next.
    #[default]
    Hierarchical,
    /// The same phases and bytes one after the other, each a call of its own: what the engine
    /// (`ParoShardedModule`) issues on its communication lane, so their times add up.
    Phased,
}

/// Tolerances of the `auto` choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Selection {
    /// The model's stated uncertainty between strategies: step times within this fraction of the fastest are a
    /// tie, which less memory breaks (default 0.01 = 1%). Wider ties cost speed: the lightest of near-equal
    /// strategies reduces more often, and on the emulated cluster it measured slower (over 26 scenario launches
    /// `auto` came within 5% of the fastest in 21 with a 1% tie, 20 with none, 11 with 5%; benchmarks/JOURNAL.md,
    /// "Shared cores: collectives take their work from compute").
    pub time_tolerance: f64,
}

impl Default for Selection {
    fn default() -> Self {
        Selection { time_tolerance: 0.01 }
    }
}

pub(super) fn validate_cluster(c: &Cluster) -> Result<()> {
    for (name, v) in [("intra_bandwidth", c.intra_bandwidth), ("inter_bandwidth", c.inter_bandwidth)] {
        if !(v.is_finite() && v > 0.0) {
            return Err(ParoError::Invalid(format!(
                "{name} {v} must be a positive number of bytes per second per rank"
            )));
        }
    }
    for (name, v) in [("intra_latency", c.intra_latency), ("inter_latency", c.inter_latency)] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(ParoError::Invalid(format!("{name} {v} must be a non-negative number of seconds")));
        }
    }
    for (name, v) in [
        ("compute_flops", c.compute_flops),
        ("optimizer_params_per_s", c.optimizer_params_per_s),
        ("intra_reduce_scatter_bandwidth", c.intra_reduce_scatter_bandwidth),
        ("inter_reduce_scatter_bandwidth", c.inter_reduce_scatter_bandwidth),
        ("inter_all_reduce_bandwidth", c.inter_all_reduce_bandwidth),
        ("unpack_bandwidth", c.unpack_bandwidth),
    ] {
        if let Some(v) = v {
            if !(v.is_finite() && v > 0.0) {
                return Err(ParoError::Invalid(format!("{name} {v} must be a positive number per second, or absent")));
            }
        }
    }
    for (name, v) in [("intra_overlap", c.intra_overlap), ("inter_overlap", c.inter_overlap)] {
        if let Some(v) = v {
            if !(0.0..=1.0).contains(&v) {
                return Err(ParoError::Invalid(format!("{name} {v} must be a fraction from 0 to 1, or absent")));
            }
        }
    }
    for (name, v) in [
        ("intra_slowdown", c.intra_slowdown),
        ("inter_slowdown", c.inter_slowdown),
        ("intra_reduce_scatter_slowdown", c.intra_reduce_scatter_slowdown),
        ("inter_reduce_scatter_slowdown", c.inter_reduce_scatter_slowdown),
    ] {
        if let Some(v) = v {
            if !(v.is_finite() && v >= 1.0) {
                return Err(ParoError::Invalid(format!("{name} {v} must be a factor of at least 1, or absent")));
            }
        }
    }
    if c.memory_bytes == 0 {
        return Err(ParoError::Invalid("memory_bytes must be the memory budget per rank in bytes, at least 1".into()));
    }
    Ok(())
}

pub(super) fn validate_training(t: &Training) -> Result<()> {
    for (name, v) in [
        ("grad_accum", t.grad_accum),
        ("micro_batch", t.micro_batch),
        ("seq_len", t.seq_len),
        ("param_bytes", t.param_bytes),
        ("grad_bytes", t.grad_bytes),
        ("reduce_bytes", t.reduce_bytes.unwrap_or(t.grad_bytes)),
        ("prefetch", t.prefetch),
    ] {
        if v == 0 {
            return Err(ParoError::Invalid(format!("training.{name} must be at least 1")));
        }
    }
    if t.grad_accum > 1_000_000 || t.prefetch > 1_000_000 {
        return Err(ParoError::Invalid("training.grad_accum and training.prefetch must be at most 1000000".into()));
    }
    Ok(())
}

pub(super) fn validate_selection(s: &Selection) -> Result<()> {
    if !(s.time_tolerance.is_finite() && s.time_tolerance >= 0.0) {
        return Err(ParoError::Invalid(format!(
            "selection.time_tolerance {} must be a non-negative fraction",
            s.time_tolerance
        )));
    }
    Ok(())
}

pub(super) fn requested_strategies(names: Option<&[String]>) -> Result<Vec<Strategy>> {
    let all = Strategy::all_valid();
    let Some(names) = names else {
        return Ok(all);
    };
    if names.is_empty() {
        return Err(ParoError::Invalid("strategies is empty; leave it out to estimate all 14".into()));
    }
    let wanted = names.iter().map(|n| Strategy::parse(n)).collect::<Result<Vec<_>>>()?;
    Ok(all.into_iter().filter(|s| wanted.contains(s)).collect())
}
