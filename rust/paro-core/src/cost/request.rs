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

/// The data-parallel cluster, per rank; one flat object in JSON (see [Note: the wire form]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "ClusterRecord", into = "ClusterRecord")]
pub struct Cluster {
    /// Number of ranks n.
    pub world: usize,
    /// Ranks per group m (fast-linked, e.g. GPUs of a node); must divide `world`.
    pub group_size: usize,
    /// The intra-group links: B' and α' (paper §3).
    pub intra: Link,
    /// The inter-group links (one rail per rank): B and α (paper §3).
    pub inter: Link,
    /// Memory budget per rank, bytes.
    pub memory_bytes: u64,
    /// Achieved training throughput of one rank, FLOP/s (a GPU's dense bf16 peak times its efficiency, or a
    /// measured probe). Without it compute is left out of the step time and nothing hides communication.
    pub compute_flops: Option<f64>,
    /// Parameters the optimizer updates per second on one rank (measured). Without it the step is free.
    pub optimizer_params_per_s: Option<f64>,
    /// Bytes per second at which a rank copies a gathered parameter buffer out into the parameters' own storage
    /// (the engine's unshard re-grows the storage it freed at the last reshard, which on the CPU may fault its
    /// pages in again). Without it the copy-out is free. Measured by `paro_torch.auto.measure_unpack`: that
    /// copy-out with every rank copying at once.
    pub unpack_bandwidth: Option<f64>,
    /// Whether the ranks compute and run their collectives, on both levels, on the same CPU cores (CPU training;
    /// `paro_torch` sets it for CPU ranks). Then a collective's work done beside compute is compute's loss one for
    /// one, whatever the levels' `overlap` say (as if both were 0), and a collective runs at its speed alone while
    /// compute waits for it: the ranks run the same schedule, so the ranks that share its cores wait for it too. On
    /// the emulated cluster this fits the measured steps best (benchmarks/JOURNAL.md, "Shared cores: collectives
    /// take their work from compute").
    pub shared_cores: bool,
}

impl Cluster {
    /// A cluster of `world` ranks in groups of `group_size` with these links and memory per rank, and nothing
    /// else measured (no throughputs, overlaps or slowdowns: see the fields for what their absence means).
    pub fn new(world: usize, group_size: usize, intra: Link, inter: Link, memory_bytes: u64) -> Cluster {
        Cluster {
            world,
            group_size,
            intra,
            inter,
            memory_bytes,
            compute_flops: None,
            optimizer_params_per_s: None,
            unpack_bandwidth: None,
            shared_cores: false,
        }
    }
}

/// The figures of one level's links (intra-group or inter-group), per rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bandwidth, bytes per second per rank (an all-gather's).
    pub bandwidth: f64,
    /// Latency of one ring step, seconds.
    pub latency: f64,
    /// How well compute runs beside this level's communication, in [0, 1]: compute loses `1 - overlap` seconds
    /// per second of the collective's work (its time alone) done beside it. 1 (the default) leaves compute as fast
    /// as alone (a GPU's copy engines and NVLink); 0 stops it while communication runs (collectives on the CPU
    /// cores the compute needs, e.g. Gloo over loopback). Measured by the probe (`paro_torch.auto`): a compute loop
    /// and an all-gather loop timed alone and at once. A call on both levels costs their average by time.
    pub overlap: Option<f64>,
    /// How much slower this level's collectives run while compute runs beside them, at least 1 (the default: as
    /// fast as alone). Measured by the same probe as `overlap`.
    pub slowdown: Option<f64>,
    /// Bandwidth of a reduce-scatter, bytes per second per rank, where it differs from an all-gather's
    /// (`bandwidth`, the default): on Gloo the engine runs it as an all-to-all and a local sum. Measured by the
    /// link probe on the engine's own reduce-scatter.
    pub reduce_scatter_bandwidth: Option<f64>,
    /// How much slower a reduce-scatter runs beside compute, at least 1 (default `slowdown`). Measured by the
    /// overlap probe with the engine's reduce-scatter in place of the all-gather.
    pub reduce_scatter_slowdown: Option<f64>,
    /// Bandwidth of an all-reduce, bytes per second per rank (of the ring's 2(k − 1)/k of the buffer), where it
    /// differs from an all-gather's (`bandwidth`, the default). Priced on the inter-group level alone: the
    /// engine's only large all-reduce is t_syncg's across groups (g = N, I with os = N, I), which the link probe
    /// measures; the wire form has no intra-group one.
    pub all_reduce_bandwidth: Option<f64>,
}

impl Link {
    /// A level's links with this bandwidth (bytes per second per rank) and latency (seconds per ring step), and
    /// nothing else measured.
    pub fn new(bandwidth: f64, latency: f64) -> Link {
        Link {
            bandwidth,
            latency,
            overlap: None,
            slowdown: None,
            reduce_scatter_bandwidth: None,
            reduce_scatter_slowdown: None,
            all_reduce_bandwidth: None,
        }
    }
}

// [Note: the wire form] In JSON a cluster is one flat object whose level figures carry their level as a prefix
// (`intra_bandwidth`, `inter_latency`, ...), as `paro plan`, `paro_torch.auto` and recorded requests write it.
// `ClusterRecord` is that form, and the two conversions below are its only readers and writers. The intra-group
// level has no all-reduce bandwidth there (see `Link::all_reduce_bandwidth`).

/// The wire form of a [`Cluster`] (its fields' meanings are there and on [`Link`]).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterRecord {
    world: usize,
    group_size: usize,
    intra_bandwidth: f64,
    inter_bandwidth: f64,
    #[serde(default)]
    intra_latency: f64,
    #[serde(default)]
    inter_latency: f64,
    memory_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    compute_flops: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    optimizer_params_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    intra_overlap: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    inter_overlap: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    intra_slowdown: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    inter_slowdown: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    intra_reduce_scatter_bandwidth: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    inter_reduce_scatter_bandwidth: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    inter_all_reduce_bandwidth: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    intra_reduce_scatter_slowdown: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    inter_reduce_scatter_slowdown: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    unpack_bandwidth: Option<f64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    shared_cores: bool,
}

impl From<ClusterRecord> for Cluster {
    fn from(r: ClusterRecord) -> Cluster {
        Cluster {
            world: r.world,
            group_size: r.group_size,
            intra: Link {
                bandwidth: r.intra_bandwidth,
                latency: r.intra_latency,
                overlap: r.intra_overlap,
                slowdown: r.intra_slowdown,
                reduce_scatter_bandwidth: r.intra_reduce_scatter_bandwidth,
                reduce_scatter_slowdown: r.intra_reduce_scatter_slowdown,
                all_reduce_bandwidth: None,
            },
            inter: Link {
                bandwidth: r.inter_bandwidth,
                latency: r.inter_latency,
                overlap: r.inter_overlap,
                slowdown: r.inter_slowdown,
                reduce_scatter_bandwidth: r.inter_reduce_scatter_bandwidth,
                reduce_scatter_slowdown: r.inter_reduce_scatter_slowdown,
                all_reduce_bandwidth: r.inter_all_reduce_bandwidth,
            },
            memory_bytes: r.memory_bytes,
            compute_flops: r.compute_flops,
            optimizer_params_per_s: r.optimizer_params_per_s,
            unpack_bandwidth: r.unpack_bandwidth,
            shared_cores: r.shared_cores,
        }
    }
}

impl From<Cluster> for ClusterRecord {
    fn from(c: Cluster) -> ClusterRecord {
        let (intra, inter) = (c.intra, c.inter);
        ClusterRecord {
            world: c.world,
            group_size: c.group_size,
            intra_bandwidth: intra.bandwidth,
            inter_bandwidth: inter.bandwidth,
            intra_latency: intra.latency,
            inter_latency: inter.latency,
            memory_bytes: c.memory_bytes,
            compute_flops: c.compute_flops,
            optimizer_params_per_s: c.optimizer_params_per_s,
            intra_overlap: intra.overlap,
            inter_overlap: inter.overlap,
            intra_slowdown: intra.slowdown,
            inter_slowdown: inter.slowdown,
            intra_reduce_scatter_bandwidth: intra.reduce_scatter_bandwidth,
            inter_reduce_scatter_bandwidth: inter.reduce_scatter_bandwidth,
            inter_all_reduce_bandwidth: inter.all_reduce_bandwidth,
            intra_reduce_scatter_slowdown: intra.reduce_scatter_slowdown,
            inter_reduce_scatter_slowdown: inter.reduce_scatter_slowdown,
            unpack_bandwidth: c.unpack_bandwidth,
            shared_cores: c.shared_cores,
        }
    }
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
    /// Bytes per master element (the trainable parameters' own dtype); default 4. Where the parameters are stored
    /// in it too (`param_bytes` at least this), the masters share their storage, except where p = N keeps the
    /// natural layout and os is sharded: then they are a copy of their own, counted with the optimizer states.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master_bytes: Option<u64>,
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
            master_bytes: None,
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
    // errors name the wire form's fields (see `Cluster`), in its order
    let levels = [("intra", &c.intra), ("inter", &c.inter)];
    for (level, link) in levels {
        let v = link.bandwidth;
        if !(v.is_finite() && v > 0.0) {
            return Err(ParoError::Invalid(format!(
                "{level}_bandwidth {v} must be a positive number of bytes per second per rank"
            )));
        }
    }
    for (level, link) in levels {
        let v = link.latency;
        if !(v.is_finite() && v >= 0.0) {
            return Err(ParoError::Invalid(format!("{level}_latency {v} must be a non-negative number of seconds")));
        }
    }
    if c.intra.all_reduce_bandwidth.is_some() {
        return Err(ParoError::Invalid(
            "an intra-group all_reduce_bandwidth is not priced (see `Link::all_reduce_bandwidth`)".into(),
        ));
    }
    let rates = [
        ("compute_flops".to_string(), c.compute_flops),
        ("optimizer_params_per_s".to_string(), c.optimizer_params_per_s),
    ]
    .into_iter()
    .chain(levels.map(|(level, link)| (format!("{level}_reduce_scatter_bandwidth"), link.reduce_scatter_bandwidth)))
    .chain([
        ("inter_all_reduce_bandwidth".to_string(), c.inter.all_reduce_bandwidth),
        ("unpack_bandwidth".to_string(), c.unpack_bandwidth),
    ]);
    for (name, v) in rates {
        if let Some(v) = v {
            if !(v.is_finite() && v > 0.0) {
                return Err(ParoError::Invalid(format!("{name} {v} must be a positive number per second, or absent")));
            }
        }
    }
    for (level, link) in levels {
        if let Some(v) = link.overlap {
            if !(0.0..=1.0).contains(&v) {
                return Err(ParoError::Invalid(format!(
                    "{level}_overlap {v} must be a fraction from 0 to 1, or absent"
                )));
            }
        }
    }
    let slowdowns = levels
        .map(|(level, link)| (format!("{level}_slowdown"), link.slowdown))
        .into_iter()
        .chain(levels.map(|(level, link)| (format!("{level}_reduce_scatter_slowdown"), link.reduce_scatter_slowdown)));
    for (name, v) in slowdowns {
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
        ("master_bytes", t.master_bytes.unwrap_or(4)),
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
