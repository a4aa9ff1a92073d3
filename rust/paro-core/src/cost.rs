//! Cost model: per-rank memory and per-step communication of every PaRO strategy (spec §4–§6), and the
//! `auto` choice. Bytes are exact integers (buffers are padded to multiples of the world size); times are an
//! α–β estimate of communication only.

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};

use crate::error::{ParoError, Result};
use crate::model::{checked_add, checked_mul, Block, LlamaShape, Model, ModelSpec, Trainable};
use crate::strategy::{Granularity, Strategy};
use crate::topology::Topology;

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
        }
    }
}

/// How a collective over all n ranks runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveAlgorithm {
    /// One ring over all n ranks in rank order (plain NCCL). g of its n hops cross groups, so g/n of the bytes
    /// count as inter (a rank average, rounded down to whole bytes); its time is paced by the inter link.
    Flat,
    /// An intra-group and an inter-group phase (PaRO-CC, what the paro backend does). Its time is the sum of
    /// the two phases: pipelining them (the "overlapping" of HO-Ring) is not modelled.
    #[default]
    Hierarchical,
}

/// Tolerances of the `auto` choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Selection {
    /// Step times within this fraction of the fastest count as a tie (default 0.05 = 5%).
    pub time_tolerance: f64,
    /// Memory savings below this fraction of the budget are not worth a slower step (default 0.05 = 5%).
    pub memory_tolerance: f64,
}

impl Default for Selection {
    fn default() -> Self {
        Selection { time_tolerance: 0.05, memory_tolerance: 0.05 }
    }
}

/// When a collective runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Gathering a block's parameters, before forward and again before backward, every micro-step.
    ParamGather,
    /// Reducing a block's gradients during backward, every micro-step.
    GradReduce,
    /// Bringing the accumulated gradients to the optimizer-state layout, once per step (t_syncg).
    SyncGrad,
    /// Rebuilding the parameter layout from the updated optimizer shards, once per step (t_syncp).
    SyncParam,
}

/// A collective operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Every rank ends with the whole buffer.
    AllGather,
    /// Every rank ends with its shard of the sum.
    ReduceScatter,
    /// Every rank ends with the whole sum.
    AllReduce,
}

/// Which ranks take part in a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// The m ranks of one group.
    Intra,
    /// The g ranks of equal local rank, one per group (a rail), on a 1/m slice.
    Inter,
    /// All n ranks.
    Global,
}

/// The collectives of one kind that a strategy runs in one training step, summed over blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Collective {
    /// When it runs.
    pub phase: Phase,
    /// What it does.
    pub op: Op,
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
    /// Predicted time per step, seconds.
    pub time_s: f64,
}

/// Memory per rank, bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    /// Parameter shards (trainable and frozen), sharded by p.
    pub params: u64,
    /// Gradient accumulation buffer of the trainable parameters, sharded by g.
    pub grads: u64,
    /// Optimizer states of the trainable parameters (K bytes each), sharded by os.
    pub optimizer_states: u64,
    /// `params + grads + optimizer_states` (spec §4).
    pub model_states: u64,
    /// Transient: gathered full parameters of the `prefetch` largest blocks (p ∈ {I, G}).
    pub gathered_params: u64,
    /// Transient: one full-size gradient of the largest block before it is reduced (g ∈ {I, G}).
    pub unsharded_grads: u64,
    /// Transient: fp32 gradient of the optimizer shard at step time (when `grad_bytes` < 4).
    pub fp32_grads: u64,
    /// Activations of one micro-batch (0 when the model has no shape).
    pub activations: u64,
    /// Sum of all of the above (a conservative peak).
    pub total: u64,
}

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
    /// Predicted communication time per training step, seconds: Σ over collectives of ring steps × latency +
    /// bytes / bandwidth. Compute is left out (it is the same for every strategy), and so is any overlap.
    pub time_s: f64,
    /// The collectives of one training step.
    pub collectives: Vec<Collective>,
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

/// Estimates memory and communication of the requested strategies and picks one.
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
        notes: notes(&model),
    })
}

fn level_index(x: Granularity) -> usize {
    match x {
        Granularity::N => 0,
        Granularity::I => 1,
        Granularity::G => 2,
    }
}

/// A block's padded (trainable, frozen) sizes at N, I and G: the engine's when given (checked), else each
/// buffer padded to a multiple of the world size.
fn block_sizes(b: &Block, n: u64, m: u64) -> Result<[(u64, u64); 3]> {
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
pub fn padded_numel(numel: u64, world: u64) -> Result<u64> {
    if world == 0 {
        return Err(ParoError::Topology("world size must be at least 1".into()));
    }
    checked_mul(numel.div_ceil(world), world, "a padded buffer size")
}

fn validate_cluster(c: &Cluster) -> Result<()> {
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
    if c.memory_bytes == 0 {
        return Err(ParoError::Invalid("memory_bytes must be the memory budget per rank in bytes, at least 1".into()));
    }
    Ok(())
}

fn validate_training(t: &Training) -> Result<()> {
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

fn validate_selection(s: &Selection) -> Result<()> {
    for (name, v) in [("time_tolerance", s.time_tolerance), ("memory_tolerance", s.memory_tolerance)] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(ParoError::Invalid(format!("selection.{name} {v} must be a non-negative fraction")));
        }
    }
    Ok(())
}

fn requested_strategies(names: Option<&[String]>) -> Result<Vec<Strategy>> {
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

fn notes(model: &Model) -> Vec<String> {
    let mut notes =
        vec!["times are communication only (compute is the same for every strategy) and assume no overlap, neither \
         with compute nor between the two phases of a hierarchical collective"
            .to_string()];
    if !model.blocks_known {
        notes.push(
            "block sizes are unknown (a bare parameter count): gathered-parameter and unsharded-gradient buffers \
             are not counted and each collective is one call over the whole model; give num_blocks, a shape or \
             blocks"
                .to_string(),
        );
    }
    if model.shape.is_none() {
        notes.push("no model shape: activations are not counted".to_string());
    }
    notes
}

/// Bytes and latency steps of some collectives; times are computed once from the sums.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Traffic {
    intra_bytes: u64,
    inter_bytes: u64,
    /// Ring steps paid at the intra latency α'.
    intra_hops: u64,
    /// Ring steps paid at the inter latency α.
    inter_hops: u64,
    /// Bytes that move at the intra bandwidth B'.
    timed_intra: u64,
    /// Bytes that move at the inter bandwidth B.
    timed_inter: u64,
}

impl Traffic {
    fn plus(self, o: Traffic) -> Result<Traffic> {
        let w = "the bytes per step";
        Ok(Traffic {
            intra_bytes: checked_add(self.intra_bytes, o.intra_bytes, w)?,
            inter_bytes: checked_add(self.inter_bytes, o.inter_bytes, w)?,
            intra_hops: checked_add(self.intra_hops, o.intra_hops, w)?,
            inter_hops: checked_add(self.inter_hops, o.inter_hops, w)?,
            timed_intra: checked_add(self.timed_intra, o.timed_intra, w)?,
            timed_inter: checked_add(self.timed_inter, o.timed_inter, w)?,
        })
    }

    fn times(self, k: u64) -> Result<Traffic> {
        let w = "the bytes per step";
        Ok(Traffic {
            intra_bytes: checked_mul(self.intra_bytes, k, w)?,
            inter_bytes: checked_mul(self.inter_bytes, k, w)?,
            intra_hops: checked_mul(self.intra_hops, k, w)?,
            inter_hops: checked_mul(self.inter_hops, k, w)?,
            timed_intra: checked_mul(self.timed_intra, k, w)?,
            timed_inter: checked_mul(self.timed_inter, k, w)?,
        })
    }

    fn is_empty(&self) -> bool {
        *self == Traffic::default()
    }
}

/// Bytes each rank sends and ring steps of a ring collective over k ranks on a buffer of `x` bytes
/// (x divisible by k): all-gather and reduce-scatter (k−1)/k·x in k−1 steps, all-reduce twice that.
fn ring(op: Op, k: u64, x: u64) -> Result<(u64, u64)> {
    if k <= 1 {
        return Ok((0, 0));
    }
    let w = "the bytes of a collective";
    let base = checked_mul(k - 1, x / k, w)?;
    match op {
        Op::AllGather | Op::ReduceScatter => Ok((base, k - 1)),
        Op::AllReduce => Ok((checked_mul(2, base, w)?, 2 * (k - 1))),
    }
}

/// Everything one strategy estimate needs.
struct Context<'a> {
    /// Ranks n, group size m, groups g.
    n: u64,
    m: u64,
    g: u64,
    req: &'a Request,
    /// Padded (trainable, frozen) element counts per block, laid out at N, I and G.
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
            m: topo.group_size as u64,
            g: topo.num_groups() as u64,
            req,
            padded,
            blocks_known: model.blocks_known,
            activations,
        })
    }

    fn degree(&self, x: Granularity) -> u64 {
        x.degree(self.m as usize, self.n as usize) as u64
    }

    /// Padded (trainable, frozen) sizes per block under `s`: the engine lays a trainable buffer out at os (its
    /// finest granularity) and a frozen one at p.
    fn sizes(&self, s: Strategy) -> Vec<(u64, u64)> {
        self.padded.iter().map(|b| (b[level_index(s.os)].0, b[level_index(s.p)].1)).collect()
    }

    fn estimate(&self, s: Strategy) -> Result<StrategyEstimate> {
        let memory = self.memory(s)?;
        let mut plan = StepPlan::default();
        self.plan_step(s, &mut plan)?;
        let mut total = Traffic::default();
        let mut collectives = Vec::with_capacity(plan.entries.len());
        for e in &plan.entries {
            total = total.plus(e.traffic)?;
            collectives.push(Collective {
                phase: e.phase,
                op: e.op,
                level: e.level,
                count: e.count,
                payload_bytes: e.payload,
                intra_bytes: e.traffic.intra_bytes,
                inter_bytes: e.traffic.inter_bytes,
                time_s: self.time(e.traffic),
            });
        }
        Ok(StrategyEstimate {
            strategy: s,
            code: s.code(),
            known_as: s.known_as().map(str::to_string),
            fits: memory.total <= self.req.cluster.memory_bytes,
            memory,
            intra_bytes: total.intra_bytes,
            inter_bytes: total.inter_bytes,
            time_s: self.time(total),
            collectives,
        })
    }

    fn memory(&self, s: Strategy) -> Result<Memory> {
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
        // fp32 masters share the parameters' storage, except where p = N keeps the parameters in their natural
        // layout and os is sharded: then the masters are a copy of their own (4 bytes per element).
        let masters = if t.param_bytes >= 4 && s.p == Granularity::N && s.os != Granularity::N { 4 } else { 0 };
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
        let fp32_grads = if t.grad_bytes < 4 { checked_mul(trainable / dos, 4, w)? } else { 0 };
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

    /// The collectives of one training step (A micro-steps and the boundary), spec §5.1.
    fn plan_step(&self, s: Strategy, plan: &mut StepPlan) -> Result<()> {
        use Granularity::{G, I, N};
        let t = &self.req.training;
        let w = "the bytes of a buffer";
        let gathers_per_step = checked_mul(2, t.grad_accum, w)?;
        let level_of = |x: Granularity| if x == I { Level::Intra } else { Level::Global };
        for (tr, fr) in self.sizes(s) {
            // Parameters: all-gather every buffer (trainable and frozen) before forward and before backward.
            if s.p != N {
                for numel in [tr, fr].into_iter().filter(|&x| x > 0) {
                    let bytes = checked_mul(numel, t.param_bytes, w)?;
                    self.add(plan, Phase::ParamGather, Op::AllGather, level_of(s.p), gathers_per_step, bytes)?;
                }
            }
            if tr == 0 {
                continue;
            }
            let grad = checked_mul(tr, t.reduce_bytes.unwrap_or(t.grad_bytes), w)?;
            let param = checked_mul(tr, t.param_bytes, w)?;
            // Gradients: reduce-scatter every micro-step to the g layout.
            if s.g != N {
                self.add(plan, Phase::GradReduce, Op::ReduceScatter, level_of(s.g), t.grad_accum, grad)?;
            }
            // t_syncg: accumulated gradients to the optimizer-state layout, by (g, os).
            let slice = grad / self.m;
            match (s.g, s.os) {
                (N, N) => self.add(plan, Phase::SyncGrad, Op::AllReduce, Level::Global, 1, grad)?,
                (N, I) => {
                    self.add(plan, Phase::SyncGrad, Op::ReduceScatter, Level::Intra, 1, grad)?;
                    self.add(plan, Phase::SyncGrad, Op::AllReduce, Level::Inter, 1, slice)?;
                }
                (N, G) => self.add(plan, Phase::SyncGrad, Op::ReduceScatter, Level::Global, 1, grad)?,
                (I, I) => self.add(plan, Phase::SyncGrad, Op::AllReduce, Level::Inter, 1, slice)?,
                (I, G) => self.add(plan, Phase::SyncGrad, Op::ReduceScatter, Level::Inter, 1, slice)?,
                _ => {}
            }
            // t_syncp: updated trainable parameters back to the p layout, by (p, os).
            match (s.p, s.os) {
                (N, I) => self.add(plan, Phase::SyncParam, Op::AllGather, Level::Intra, 1, param)?,
                (N, G) => self.add(plan, Phase::SyncParam, Op::AllGather, Level::Global, 1, param)?,
                (I, G) => self.add(plan, Phase::SyncParam, Op::AllGather, Level::Inter, 1, param / self.m)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// Adds `count` calls of a collective on a buffer of `bytes` (a 1/m slice for the inter level).
    fn add(&self, plan: &mut StepPlan, phase: Phase, op: Op, level: Level, count: u64, bytes: u64) -> Result<()> {
        let one = self.traffic(op, level, bytes)?;
        if one.is_empty() {
            return Ok(());
        }
        let traffic = one.times(count)?;
        let payload = checked_mul(bytes, count, "the bytes per step")?;
        match plan.entries.iter_mut().find(|e| e.phase == phase && e.op == op && e.level == level) {
            Some(e) => {
                e.count = checked_add(e.count, count, "the calls per step")?;
                e.payload = checked_add(e.payload, payload, "the bytes per step")?;
                e.traffic = e.traffic.plus(traffic)?;
            }
            None => plan.entries.push(Entry { phase, op, level, count, payload, traffic }),
        }
        Ok(())
    }

    /// Bytes and ring steps of one call.
    fn traffic(&self, op: Op, level: Level, x: u64) -> Result<Traffic> {
        let intra = |op, x| -> Result<Traffic> {
            let (bytes, hops) = ring(op, self.m, x)?;
            Ok(Traffic { intra_bytes: bytes, intra_hops: hops, timed_intra: bytes, ..Traffic::default() })
        };
        let inter = |op, x| -> Result<Traffic> {
            let (bytes, hops) = ring(op, self.g, x)?;
            Ok(Traffic { inter_bytes: bytes, inter_hops: hops, timed_inter: bytes, ..Traffic::default() })
        };
        match level {
            Level::Intra => intra(op, x),
            Level::Inter => inter(op, x),
            Level::Global => match self.req.collectives {
                CollectiveAlgorithm::Hierarchical => {
                    let slice = x / self.m;
                    match op {
                        Op::AllGather => inter(Op::AllGather, slice)?.plus(intra(Op::AllGather, x)?),
                        Op::ReduceScatter => intra(Op::ReduceScatter, x)?.plus(inter(Op::ReduceScatter, slice)?),
                        Op::AllReduce => intra(Op::ReduceScatter, x)?
                            .plus(inter(Op::AllReduce, slice)?)?
                            .plus(intra(Op::AllGather, x)?),
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
                    // g of the n hops of the ring cross groups; the slowest hop sets the pace of all.
                    let crossing = (bytes as u128 * self.g as u128 / self.n as u128) as u64;
                    Ok(Traffic {
                        intra_bytes: bytes - crossing,
                        inter_bytes: crossing,
                        inter_hops: hops,
                        timed_inter: bytes,
                        ..Traffic::default()
                    })
                }
            },
        }
    }

    /// α–β time: ring steps × latency + bytes / bandwidth, per level, summed.
    fn time(&self, t: Traffic) -> f64 {
        let c = &self.req.cluster;
        t.intra_hops as f64 * c.intra_latency
            + t.inter_hops as f64 * c.inter_latency
            + t.timed_intra as f64 / c.intra_bandwidth
            + t.timed_inter as f64 / c.inter_bandwidth
    }
}

/// One (phase, op, level) row being summed over blocks.
struct Entry {
    phase: Phase,
    op: Op,
    level: Level,
    count: u64,
    payload: u64,
    traffic: Traffic,
}

/// The collectives of one strategy's step, one entry per (phase, op, level), in order of first use.
#[derive(Default)]
struct StepPlan {
    entries: Vec<Entry>,
}

/// Picks the strategy: among those that fit, the ones within `time_tolerance` of the fastest are a tie;
/// among those, any within `memory_tolerance`·budget of the lightest may be taken, and the fastest of
/// these wins. Among exact ties, those whose parameter sync across the slow links (t_syncp: it runs before
/// forward and can hide only behind the forward pass, where t_syncg hides behind the longer backward) takes
/// over `time_tolerance` of the step's communication longer than the least are dropped; then less memory
/// wins, then the canonical order.
fn choose(
    estimates: &[StrategyEstimate],
    budget: u64,
    sel: &Selection,
    training: &Training,
    model: &Model,
) -> (Option<Choice>, String) {
    let fitting: Vec<&StrategyEstimate> = estimates.iter().filter(|e| e.fits).collect();
    let Some(fastest) = fitting.iter().map(|e| e.time_s).min_by(f64::total_cmp) else {
        return (None, no_fit_reason(estimates, budget, training, model));
    };
    let near: Vec<&StrategyEstimate> =
        fitting.iter().copied().filter(|e| e.time_s <= fastest * (1.0 + sel.time_tolerance)).collect();
    let lightest = near.iter().map(|e| e.memory.total).min().unwrap_or(0);
    let slack = sel.memory_tolerance * budget as f64;
    let light: Vec<&StrategyEstimate> =
        near.iter().copied().filter(|e| (e.memory.total - lightest) as f64 <= slack).collect();
    let Some(quickest) = light.iter().map(|e| e.time_s).min_by(f64::total_cmp) else {
        return (None, no_fit_reason(estimates, budget, training, model));
    };
    let tied: Vec<&StrategyEstimate> = light.iter().copied().filter(|e| e.time_s == quickest).collect();
    let least_syncp = tied.iter().map(|e| sync_param_s(e)).min_by(f64::total_cmp).unwrap_or(0.0);
    let Some(best) = tied
        .iter()
        .filter(|e| sync_param_s(e) <= least_syncp + sel.time_tolerance * quickest)
        .min_by_key(|e| e.memory.total)
    else {
        return (None, no_fit_reason(estimates, budget, training, model));
    };
    let reason = choice_reason(best, &near, fitting.len(), estimates.len(), fastest, budget, sel);
    (
        Some(Choice {
            strategy: best.strategy,
            code: best.code.clone(),
            known_as: best.known_as.clone(),
            reason: reason.clone(),
        }),
        reason,
    )
}

/// Seconds of a strategy's predicted communication spent in the parameter sync (t_syncp) on collectives that
/// cross the slow links (inter-group or global); intra-group ones are cheap and left out.
fn sync_param_s(e: &StrategyEstimate) -> f64 {
    e.collectives
        .iter()
        .filter(|c| c.phase == Phase::SyncParam && c.level != Level::Intra)
        .fold(0.0, |t, c| t + c.time_s)
}

fn choice_reason(
    best: &StrategyEstimate,
    near: &[&StrategyEstimate],
    fitting: usize,
    total: usize,
    fastest: f64,
    budget: u64,
    sel: &Selection,
) -> String {
    let pct = |x: f64| format!("{}%", trim_float(x * 100.0));
    let fit = if fitting == total {
        format!("all {total} strategies, which all fit in {} per rank", gb(budget))
    } else {
        format!("the {fitting} of {total} strategies that fit in {} per rank", gb(budget))
    };
    let cost = format!("{} of communication per step, {} per rank", secs(best.time_s), gb(best.memory.total));
    let head = if fitting == 1 {
        format!("{}: the only one of the {total} strategies that fits in {} per rank ({cost})", best.code, gb(budget))
    } else if best.time_s <= fastest {
        format!("{}: fastest of {fit} ({cost})", best.code)
    } else {
        format!(
            "{}: within {} of the fastest of {fit} ({cost}); every faster one needs over {} ({} of the budget) \
             more than the lightest of those within {}",
            best.code,
            pct(sel.time_tolerance),
            gb((sel.memory_tolerance * budget as f64) as u64),
            pct(sel.memory_tolerance),
            pct(sel.time_tolerance)
        )
    };
    let mut others: Vec<&&StrategyEstimate> = near.iter().filter(|e| e.code != best.code).collect();
    others.sort_by(|a, b| a.time_s.total_cmp(&b.time_s).then(a.memory.total.cmp(&b.memory.total)));
    let mut parts = vec![head];
    for o in others.iter().take(3) {
        let more = o.memory.total.cmp(&best.memory.total);
        let diff = gb(o.memory.total.abs_diff(best.memory.total));
        let speed = match o.time_s.total_cmp(&best.time_s) {
            Ordering::Equal => "is as fast".to_string(),
            Ordering::Less => format!("is {} faster", pct(1.0 - o.time_s / best.time_s)),
            Ordering::Greater => format!("is {} slower", pct(o.time_s / best.time_s - 1.0)),
        };
        // a tie that is lighter is within the memory slack too: `choose` dropped it for its t_syncp
        if o.time_s == best.time_s && more == Ordering::Less {
            parts.push(format!(
                "{} is as fast and needs {diff} less per rank, but spends {} of it across groups in the parameter \
                 sync before forward (against {}), which only the forward pass can hide",
                o.code,
                secs(sync_param_s(o)),
                secs(sync_param_s(best))
            ));
            continue;
        }
        let part = match more {
            Ordering::Greater => format!("{} {speed} but needs {diff} more per rank", o.code),
            Ordering::Equal => format!("{} {speed} and needs the same memory", o.code),
            Ordering::Less => format!(
                "{} {speed} and needs {diff} less per rank, under the {} ({} of the budget) worth a slower step",
                o.code,
                gb((sel.memory_tolerance * budget as f64) as u64),
                pct(sel.memory_tolerance)
            ),
        };
        parts.push(part);
    }
    parts.join("; ")
}

fn no_fit_reason(estimates: &[StrategyEstimate], budget: u64, training: &Training, model: &Model) -> String {
    let Some(smallest) = estimates.iter().min_by_key(|e| e.memory.total) else {
        return "no strategy was estimated".to_string();
    };
    let m = &smallest.memory;
    let buffers = m.gathered_params + m.unsharded_grads + m.fp32_grads;
    let mut fixes = vec!["add ranks"];
    if model.shape.is_some() && m.activations > 0 {
        if !training.activation_checkpointing {
            fixes.push("turn on activation checkpointing");
        }
        fixes.push("lower the micro-batch or the sequence length");
    }
    if training.prefetch > 1 && smallest.strategy.p != Granularity::N {
        fixes.push("prefetch fewer blocks");
    }
    format!(
        "no strategy fits in {} per rank: the smallest, {}, needs {} ({} model states, {} buffers, {} activations); {}",
        gb(budget),
        smallest.code,
        gb(m.total),
        gb(m.model_states),
        gb(buffers),
        gb(m.activations),
        fixes.join(", ")
    )
}

/// Bytes as GB (1e9) with one decimal from 1 GB up, two down to 10 MB, else as MB, or bytes below 1 MB.
fn gb(bytes: u64) -> String {
    let x = bytes as f64 / 1e9;
    if x >= 1.0 {
        format!("{x:.1} GB")
    } else if x >= 0.01 {
        format!("{x:.2} GB")
    } else if bytes >= 1_000_000 {
        format!("{:.1} MB", bytes as f64 / 1e6)
    } else {
        format!("{bytes} B")
    }
}

/// Seconds with a unit that keeps three significant digits.
fn secs(t: f64) -> String {
    if t >= 1.0 {
        format!("{t:.2} s")
    } else if t >= 1e-3 {
        format!("{:.1} ms", t * 1e3)
    } else {
        format!("{:.1} µs", t * 1e6)
    }
}

/// A percentage without trailing zeros: 1, 0.5, 12.3.
fn trim_float(x: f64) -> String {
    let s = format!("{x:.1}");
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Block;
    use proptest::prelude::*;

    const GB: f64 = 1e9;
    /// LLaMA-7B exactly, and LLaMA-65B as the Ψ = 65.2e9 that spec §4's table uses.
    const PSI_7B: u64 = 6_738_415_616;
    const PSI_65B: u64 = 65_200_000_000;

    fn cluster(world: usize) -> Cluster {
        Cluster {
            world,
            group_size: 8,
            intra_bandwidth: 150e9,
            inter_bandwidth: 12.5e9,
            intra_latency: 5e-6,
            inter_latency: 2e-5,
            memory_bytes: 80_000_000_000,
        }
    }

    fn request(model: ModelSpec, trainable: Option<Trainable>, cluster: Cluster) -> Request {
        Request {
            model,
            trainable,
            cluster,
            training: Training { grad_accum: 4, ..Training::default() },
            collectives: CollectiveAlgorithm::Hierarchical,
            strategies: None,
            selection: Selection::default(),
        }
    }

    fn params(count: u64) -> ModelSpec {
        ModelSpec { params: Some(count), ..ModelSpec::default() }
    }

    fn preset(name: &str) -> ModelSpec {
        ModelSpec { preset: Some(name.to_string()), ..ModelSpec::default() }
    }

    fn blocks(b: &[(u64, u64)]) -> ModelSpec {
        ModelSpec {
            blocks: Some(b.iter().map(|&(numel, trainable)| Block { numel, trainable, padded: None }).collect()),
            ..ModelSpec::default()
        }
    }

    fn find<'r>(report: &'r Report, code: &str) -> &'r StrategyEstimate {
        report.strategies.iter().find(|s| s.code == code).expect("strategy in report")
    }

    /// What a collective is, without its sizes.
    type Kind = (Phase, Op, Level);

    fn kinds(e: &StrategyEstimate) -> Vec<Kind> {
        e.collectives.iter().map(|c| (c.phase, c.op, c.level)).collect()
    }

    #[test]
    fn reproduces_the_model_state_table_of_spec_section_4() {
        // Columns: 7B n=32 full, 7B n=32 Ψ/16, 65B n=64 full, 65B n=64 Ψ/16, 65B n=64 PEFT 3/1000; m = 8, GB = 1e9 B.
        let table: [(&str, [f64; 5]); 14] = [
            ("NNN", [107.8, 19.4, 1043.2, 187.4, 133.1]),
            ("NNI", [37.1, 15.0, 358.6, 144.7, 131.1]),
            ("NNG", [29.5, 14.5, 273.0, 139.3, 130.8]),
            ("NII", [25.3, 14.2, 244.5, 137.5, 130.7]),
            ("NIG", [17.7, 13.7, 158.9, 132.2, 130.5]),
            ("NGG", [16.4, 13.7, 144.7, 131.3, 130.4]),
            ("INI", [25.3, 3.2, 244.5, 30.6, 17.0]),
            ("ING", [17.7, 2.7, 158.9, 25.2, 16.7]),
            ("III", [13.5, 2.4, 130.4, 23.4, 16.6]),
            ("IIG", [5.9, 1.9, 44.8, 18.1, 16.4]),
            ("IGG", [4.6, 1.9, 30.6, 17.2, 16.3]),
            ("GNG", [16.4, 1.4, 144.7, 11.0, 2.5]),
            ("GIG", [4.6, 0.7, 30.6, 3.8, 2.1]),
            ("GGG", [3.4, 0.6, 16.3, 2.9, 2.1]),
        ];
        let columns = [
            (PSI_7B, 32, 1.0),
            (PSI_7B, 32, 1.0 / 16.0),
            (PSI_65B, 64, 1.0),
            (PSI_65B, 64, 1.0 / 16.0),
            (PSI_65B, 64, 0.003),
        ];
        for (col, &(psi, world, fraction)) in columns.iter().enumerate() {
            let report = estimate(&request(params(psi), Some(Trainable::Fraction(fraction)), cluster(world))).unwrap();
            for (code, row) in &table {
                let got = find(&report, code).memory.model_states as f64 / GB;
                assert!((got - row[col]).abs() <= 0.05 + 1e-9, "{code} column {col}: {got:.3} GB vs {}", row[col]);
            }
        }
        // The headline cell exactly: IIG, 65B, full: 2Ψ/8 + 2Ψ/8 + 12Ψ/64 = 44.825e9 bytes.
        let report = estimate(&request(params(PSI_65B), None, cluster(64))).unwrap();
        let m = &find(&report, "IIG").memory;
        assert_eq!((m.params, m.grads, m.optimizer_states), (16_300_000_000, 16_300_000_000, 12_225_000_000));
        assert_eq!(m.model_states, 44_825_000_000);
    }

    #[test]
    fn memory_breakdown_with_padding_and_transients() {
        // n = 4, m = 2: block 0 has 6 trainable (padded 8) and 4 frozen (4); block 1 has 7 frozen (padded 8).
        let mut req = request(blocks(&[(10, 6), (7, 0)]), None, Cluster { world: 4, group_size: 2, ..cluster(4) });
        req.strategies = Some(vec!["IIG".into(), "NNN".into(), "GGG".into()]);
        let report = estimate(&req).unwrap();
        let iig = &find(&report, "IIG").memory;
        assert_eq!((iig.params, iig.grads, iig.optimizer_states), (20 / 2 * 2, 8 / 2 * 2, 8 / 4 * 12));
        assert_eq!(iig.gathered_params, (12 + 8) * 2, "the two largest blocks, gathered");
        assert_eq!(iig.unsharded_grads, 8 * 2, "the full gradient of the largest trainable buffer");
        assert_eq!(iig.fp32_grads, 4 * 8 / 4);
        assert_eq!(iig.activations, 0);
        assert_eq!(iig.total, 20 + 8 + 24 + 40 + 16 + 8);
        let nnn = &find(&report, "NNN").memory;
        assert_eq!((nnn.gathered_params, nnn.unsharded_grads, nnn.fp32_grads), (0, 0, 32));
        assert_eq!(nnn.model_states, 20 * 2 + 8 * 2 + 8 * 12);
        // prefetch 1 holds one block; 4-byte gradients need no fp32 copy.
        req.training.prefetch = 1;
        req.training.grad_bytes = 4;
        let report = estimate(&req).unwrap();
        let ggg = &find(&report, "GGG").memory;
        assert_eq!((ggg.gathered_params, ggg.unsharded_grads, ggg.fp32_grads), (12 * 2, 8 * 4, 0));
    }

    #[test]
    fn exact_bytes_and_time_of_one_iig_step() {
        // n = 4, m = 2, g = 2, A = 3, 2-byte params and grads; unit bandwidths and latencies for easy time.
        let mut req = request(
            blocks(&[(10, 6), (7, 0)]),
            None,
            Cluster {
                world: 4,
                group_size: 2,
                intra_bandwidth: 1.0,
                inter_bandwidth: 0.5,
                intra_latency: 1.0,
                inter_latency: 10.0,
                memory_bytes: 1 << 40,
            },
        );
        req.training.grad_accum = 3;
        req.strategies = Some(vec!["IIG".into()]);
        let report = estimate(&req).unwrap();
        let iig = find(&report, "IIG");
        let rows: Vec<(Phase, Op, Level, u64, u64, u64, u64)> = iig
            .collectives
            .iter()
            .map(|c| (c.phase, c.op, c.level, c.count, c.payload_bytes, c.intra_bytes, c.inter_bytes))
            .collect();
        assert_eq!(
            rows,
            vec![
                // buffers of 16, 8 and 16 bytes, gathered twice per micro-step: (m−1)/m of each.
                (Phase::ParamGather, Op::AllGather, Level::Intra, 18, 6 * 40, 6 * 20, 0),
                (Phase::GradReduce, Op::ReduceScatter, Level::Intra, 3, 3 * 16, 3 * 8, 0),
                // the 1/m slice (8 bytes) among g = 2 ranks: (g−1)/g of it.
                (Phase::SyncGrad, Op::ReduceScatter, Level::Inter, 1, 8, 0, 4),
                (Phase::SyncParam, Op::AllGather, Level::Inter, 1, 8, 0, 4),
            ]
        );
        assert_eq!((iig.intra_bytes, iig.inter_bytes), (144, 8));
        // 21 intra ring steps at 1 s, 2 inter steps at 10 s, 144 B at 1 B/s, 8 B at 0.5 B/s.
        assert_eq!(iig.time_s, 21.0 + 20.0 + 144.0 + 16.0);
        let sum: f64 = iig.collectives.iter().map(|c| c.time_s).sum();
        assert!((sum - iig.time_s).abs() < 1e-9);
    }

    #[test]
    fn collectives_follow_the_table_of_spec_section_5_2() {
        use Level::{Global, Inter, Intra};
        use Op::{AllGather as AG, AllReduce as AR, ReduceScatter as RS};
        use Phase::{GradReduce as GR, ParamGather as PG, SyncGrad as SG, SyncParam as SP};
        let expected: [(&str, Vec<Kind>); 14] = [
            ("NNN", vec![(SG, AR, Global)]),
            ("NNI", vec![(SG, RS, Intra), (SG, AR, Inter), (SP, AG, Intra)]),
            ("NNG", vec![(SG, RS, Global), (SP, AG, Global)]),
            ("NII", vec![(GR, RS, Intra), (SG, AR, Inter), (SP, AG, Intra)]),
            ("NIG", vec![(GR, RS, Intra), (SG, RS, Inter), (SP, AG, Global)]),
            ("NGG", vec![(GR, RS, Global), (SP, AG, Global)]),
            ("INI", vec![(PG, AG, Intra), (SG, RS, Intra), (SG, AR, Inter)]),
            ("ING", vec![(PG, AG, Intra), (SG, RS, Global), (SP, AG, Inter)]),
            ("III", vec![(PG, AG, Intra), (GR, RS, Intra), (SG, AR, Inter)]),
            ("IIG", vec![(PG, AG, Intra), (GR, RS, Intra), (SG, RS, Inter), (SP, AG, Inter)]),
            ("IGG", vec![(PG, AG, Intra), (GR, RS, Global), (SP, AG, Inter)]),
            ("GNG", vec![(PG, AG, Global), (SG, RS, Global)]),
            ("GIG", vec![(PG, AG, Global), (GR, RS, Intra), (SG, RS, Inter)]),
            ("GGG", vec![(PG, AG, Global), (GR, RS, Global)]),
        ];
        let report =
            estimate(&request(params(1 << 20), None, Cluster { world: 16, group_size: 4, ..cluster(16) })).unwrap();
        for (code, kinds_expected) in &expected {
            let e = find(&report, code);
            assert_eq!(&kinds(e), kinds_expected, "{code}");
            for c in &e.collectives {
                let per_step = match c.phase {
                    Phase::ParamGather => 2 * 4,
                    Phase::GradReduce => 4,
                    Phase::SyncGrad | Phase::SyncParam => 1,
                };
                assert_eq!(c.count, per_step, "{code} {:?}", c.phase);
            }
        }
    }

    #[test]
    fn volumes_match_the_ring_formulas_at_scale() {
        // 65B full on n = 64, m = 8, g = 8, single block: X = 2Ψ bytes (Ψ divisible by 64).
        let report = estimate(&request(params(PSI_65B), None, cluster(64))).unwrap();
        let (x, a) = (2 * PSI_65B, 4);
        let iig = find(&report, "IIG");
        assert_eq!(iig.intra_bytes, a * 2 * (7 * x / 8) + a * (7 * x / 8));
        assert_eq!(iig.inter_bytes, 2 * (7 * (x / 8) / 8));
        // Hierarchical global all-reduce (DDP): intra 2(m−1)/m·X, inter 2(g−1)/g·X/m.
        let nnn = find(&report, "NNN");
        assert_eq!((nnn.intra_bytes, nnn.inter_bytes), (2 * 7 * x / 8, 2 * 7 * (x / 8) / 8));
        // ZeRO-3: per micro-step two global all-gathers of params and one global reduce-scatter of grads.
        let ggg = find(&report, "GGG");
        let global = 7 * x / 8 + 7 * (x / 8) / 8;
        assert_eq!(ggg.intra_bytes + ggg.inter_bytes, a * 3 * global);
        // The same global collectives as one flat ring: (n−1)/n·X per rank, g/n of it across groups.
        let mut req = request(params(PSI_65B), None, cluster(64));
        req.collectives = CollectiveAlgorithm::Flat;
        let flat = estimate(&req).unwrap();
        let nnn = find(&flat, "NNN");
        let ring = 2 * 63 * (x / 64);
        assert_eq!(nnn.intra_bytes + nnn.inter_bytes, ring);
        assert_eq!(nnn.inter_bytes, ring * 8 / 64);
        // Its time is paced by the inter link: 2(n−1) steps at α and the whole volume at B.
        let expected = 2.0 * 63.0 * 2e-5 + ring as f64 / 12.5e9;
        assert!((nnn.time_s - expected).abs() < 1e-9 * expected);
        // Intra- and inter-level collectives are the same in both algorithms.
        assert_eq!(find(&flat, "III").collectives, find(&report, "III").collectives);
    }

    #[test]
    fn hierarchical_time_ignores_os_for_fixed_p_and_g_but_flat_does_not() {
        let mut req = request(preset("llama-7b"), Some(Trainable::Fraction(1.0 / 16.0)), cluster(32));
        let report = estimate(&req).unwrap();
        for (a, b) in [("NII", "NIG"), ("III", "IIG"), ("INI", "ING"), ("NNN", "NNI"), ("NNI", "NNG")] {
            assert_eq!(find(&report, a).time_s, find(&report, b).time_s, "{a} vs {b}");
            assert!(find(&report, a).memory.total > find(&report, b).memory.total, "{a} vs {b}");
        }
        req.collectives = CollectiveAlgorithm::Flat;
        let flat = estimate(&req).unwrap();
        assert!(find(&flat, "NIG").time_s > find(&flat, "NII").time_s);
        assert!(find(&flat, "GGG").time_s > find(&report, "GGG").time_s);
    }

    /// Scenario settings: m = 8, 80 GB per rank, A = 4, B' = 150 GB/s and B = 12.5 GB/s (100 Gbit/s) per rank,
    /// α' = 5 µs, α = 20 µs, bf16 + Adam, activation checkpointing, prefetch 2; each scenario is run with the
    /// authors' example settings (micro-batch 2, sequence 128) and with micro-batch 1, sequence 2048.
    fn scenario(model: &str, world: usize, fraction: f64, algorithm: CollectiveAlgorithm) -> Vec<Report> {
        [(2, 128), (1, 2048)]
            .iter()
            .map(|&(micro_batch, seq_len)| {
                let mut req = request(preset(model), Some(Trainable::Fraction(fraction)), cluster(world));
                req.training.micro_batch = micro_batch;
                req.training.seq_len = seq_len;
                req.collectives = algorithm;
                estimate(&req).unwrap()
            })
            .collect()
    }

    fn chosen(report: &Report) -> &str {
        report.choice.as_ref().map(|c| c.code.as_str()).unwrap_or("none")
    }

    #[test]
    fn exact_ties_avoid_a_long_parameter_sync() {
        // The 2 x 2 benchmark at 200 Mbit/s: NNN, NNI and NNG move the same inter-group bytes and tie, but
        // NNG's half of them in t_syncp (before forward) measured ~25% slower; NNI's t_syncp is intra only, and
        // NNI needs less memory (and optimizer work) than NNN.
        let cluster = Cluster {
            world: 4,
            group_size: 2,
            intra_bandwidth: 148e6,
            inter_bandwidth: 14.5e6,
            intra_latency: 2e-3,
            inter_latency: 7e-3,
            memory_bytes: 6_000_000_000,
        };
        let block = (1_623_552, 1_623_552);
        let mut req = request(blocks(&[block, block, block, block, (3_143_040, 3_143_040)]), None, cluster);
        req.training.grad_accum = 2;
        let report = estimate(&req).unwrap();
        let (nnn, nni, nng) = (find(&report, "NNN"), find(&report, "NNI"), find(&report, "NNG"));
        assert!(nnn.time_s == nni.time_s && nni.time_s == nng.time_s);
        assert!(nng.memory.total < nni.memory.total && nni.memory.total < nnn.memory.total);
        assert!(sync_param_s(nng) > sync_param_s(nni) + 0.05 * nng.time_s, "NNG's t_syncp crosses the slow link");
        assert_eq!(sync_param_s(nni), sync_param_s(nnn), "NNI's t_syncp is intra-group only");
        assert_eq!(chosen(&report), "NNI", "{}", report.reason);
        assert!(report.reason.contains("NNG is as fast and needs"), "{}", report.reason);
        assert!(report.reason.contains("across groups in the parameter sync before forward"), "{}", report.reason);
        assert!(report.reason.contains("NNN is as fast but needs"), "{}", report.reason);
    }

    #[test]
    fn scenario_65b_full_training_picks_iig() {
        for report in scenario("llama-65b", 64, 1.0, CollectiveAlgorithm::Hierarchical) {
            assert_eq!(chosen(&report), "IIG", "{}", report.reason);
            assert!(!find(&report, "III").fits, "MiCS needs ~130 GB of model states");
            assert!(report.reason.starts_with("IIG: fastest of the 4 of 14"), "{}", report.reason);
        }
    }

    #[test]
    fn scenario_65b_partial_training_picks_iig() {
        for report in scenario("llama-65b", 64, 1.0 / 16.0, CollectiveAlgorithm::Hierarchical) {
            assert_eq!(chosen(&report), "IIG", "{}", report.reason);
            // IIG and MiCS are equally fast; ING defers all gradient traffic to the boundary and is 2.3% faster,
            // but needs 7 GB more per rank (its gradients are not sharded).
            let (iig, iii, ing) = (find(&report, "IIG"), find(&report, "III"), find(&report, "ING"));
            assert_eq!(iig.time_s, iii.time_s);
            assert!(ing.time_s < iig.time_s && ing.time_s > iig.time_s * 0.95);
            assert!(ing.memory.total > iig.memory.total + 4_000_000_000);
            assert!(report.reason.contains("III is as fast but needs 7.1 GB more"), "{}", report.reason);
            assert!(find(&report, "IGG").time_s > iig.time_s * 1.02);
        }
    }

    #[test]
    fn scenario_65b_peft_picks_ing() {
        for report in scenario("llama-65b", 64, 0.003, CollectiveAlgorithm::Hierarchical) {
            assert_eq!(chosen(&report), "ING", "{}", report.reason);
            let ing = find(&report, "ING");
            for code in ["IIG", "III", "IGG", "GGG"] {
                assert!(find(&report, code).time_s > ing.time_s, "{code}");
            }
            assert!(report.reason.contains("INI is as fast but needs"), "{}", report.reason);
        }
    }

    #[test]
    fn scenario_7b_partial_flat_ranks_nii_nig_ngg() {
        for report in scenario("llama-7b", 32, 1.0 / 16.0, CollectiveAlgorithm::Flat) {
            let t = |code| find(&report, code).time_s;
            assert!(t("NII") < t("NIG") && t("NIG") < t("NGG"), "{} {} {}", t("NII"), t("NIG"), t("NGG"));
            assert!(["NII", "NIG", "NGG"].iter().all(|c| find(&report, c).fits));
        }
    }

    #[test]
    fn nothing_fits_names_the_smallest() {
        let mut req = request(preset("llama-65b"), None, cluster(16));
        req.cluster.memory_bytes = 10_000_000_000;
        let report = estimate(&req).unwrap();
        assert!(report.choice.is_none());
        assert!(
            report.reason.starts_with("no strategy fits in 10.0 GB per rank: the smallest, GGG, needs"),
            "{}",
            report.reason
        );
        assert!(report.reason.contains("add ranks"), "{}", report.reason);
    }

    #[test]
    fn only_one_fits_and_exact_ties_go_to_less_memory() {
        let mut req = request(params(PSI_65B), None, cluster(64));
        req.cluster.memory_bytes = 21_000_000_000;
        let report = estimate(&req).unwrap();
        assert_eq!(chosen(&report), "GGG");
        assert!(report.reason.contains("the only one of the 14"), "{}", report.reason);
        // Hierarchical collectives: NII and NIG are equal in time, and NIG (finer os) is lighter.
        let mut req = request(params(PSI_7B), Some(Trainable::Fraction(1.0 / 16.0)), cluster(32));
        req.strategies = Some(vec!["NII".into(), "NIG".into()]);
        req.selection = Selection { time_tolerance: 0.0, memory_tolerance: 0.0 };
        let report = estimate(&req).unwrap();
        assert_eq!(chosen(&report), "NIG");
    }

    #[test]
    fn strategy_subsets_aliases_and_names() {
        let mut req = request(params(1000), None, cluster(8));
        req.strategies = Some(vec!["zero3".into(), "IIG".into(), "ggg".into()]);
        let report = estimate(&req).unwrap();
        let codes: Vec<&str> = report.strategies.iter().map(|s| s.code.as_str()).collect();
        assert_eq!(codes, ["IIG", "GGG"]);
        assert_eq!(find(&report, "GGG").known_as.as_deref(), Some("zero3"));
        assert_eq!(find(&report, "IIG").known_as, None);
        req.strategies = Some(vec!["INN".into()]);
        assert!(matches!(estimate(&req), Err(ParoError::EliminatedStrategy { .. })));
        req.strategies = Some(vec!["zero4".into()]);
        assert!(matches!(estimate(&req), Err(ParoError::UnknownStrategy(..))));
        req.strategies = Some(vec![]);
        assert!(estimate(&req).is_err());
    }

    #[test]
    fn a_bare_count_has_no_block_buffers_unless_split() {
        let report = estimate(&request(params(PSI_7B), None, cluster(32))).unwrap();
        assert_eq!(find(&report, "GGG").memory.gathered_params, 0);
        assert!(report.notes.iter().any(|n| n.contains("block sizes are unknown")));
        assert!(report.notes.iter().any(|n| n.contains("activations are not counted")));
        let split = ModelSpec { params: Some(PSI_7B), num_blocks: Some(32), ..ModelSpec::default() };
        let report = estimate(&request(split, None, cluster(32))).unwrap();
        let ggg = find(&report, "GGG");
        assert_eq!(ggg.memory.gathered_params, 2 * 2 * padded_numel(PSI_7B.div_ceil(32), 32).unwrap());
        assert_eq!(ggg.collectives[0].count, 32 * 2 * 4);
    }

    #[test]
    fn degenerate_topologies_have_no_empty_collectives() {
        // One rank: nothing to communicate.
        let report = estimate(&request(params(1000), None, Cluster { world: 1, group_size: 1, ..cluster(1) })).unwrap();
        assert!(report.strategies.iter().all(|s| s.collectives.is_empty() && s.time_s == 0.0));
        // One group: no inter traffic; one rank per group: no intra traffic.
        let report = estimate(&request(params(1000), None, Cluster { world: 8, group_size: 8, ..cluster(8) })).unwrap();
        assert!(report.strategies.iter().all(|s| s.inter_bytes == 0));
        let report = estimate(&request(params(1000), None, Cluster { world: 8, group_size: 1, ..cluster(8) })).unwrap();
        assert!(report.strategies.iter().all(|s| s.intra_bytes == 0));
        for s in &report.strategies {
            assert!(s.collectives.iter().all(|c| c.count > 0 && c.intra_bytes + c.inter_bytes > 0), "{}", s.code);
        }
    }

    #[test]
    fn activations_come_from_the_shape() {
        let mut req = request(preset("llama-7b"), None, cluster(32));
        req.training.micro_batch = 2;
        req.training.seq_len = 2048;
        let report = estimate(&req).unwrap();
        let shape = LlamaShape::preset("llama-7b").unwrap();
        let act = shape.activation_bytes(2, 2048, true).unwrap();
        assert!(report.strategies.iter().all(|s| s.memory.activations == act));
        req.training.activation_checkpointing = false;
        let report = estimate(&req).unwrap();
        assert!(report.strategies[0].memory.activations > act);
        assert_eq!(report.model.params, PSI_7B);
        assert_eq!(report.model.blocks, 34);
    }

    const EXAMPLE: &str = r#"{
        "model": {"preset": "llama-65b"},
        "trainable": {"fraction": 0.0625},
        "cluster": {"world": 64, "group_size": 8, "intra_bandwidth": 150e9, "inter_bandwidth": 12.5e9,
                    "intra_latency": 5e-6, "inter_latency": 2e-5, "memory_bytes": 80000000000},
        "training": {"grad_accum": 4, "micro_batch": 2, "seq_len": 128},
        "collectives": "hierarchical"
    }"#;

    #[test]
    fn json_round_trip() {
        let out = estimate_json(EXAMPLE).unwrap();
        let report: Report = serde_json::from_str(&out).unwrap();
        assert_eq!(report.choice.as_ref().unwrap().code, "IIG");
        assert_eq!(report.strategies.len(), 14);
        let value: serde_json::Value = serde_json::from_str(&out).unwrap();
        let first = &value["strategies"][9];
        assert_eq!(first["code"], "IIG");
        assert_eq!(first["strategy"], serde_json::json!({"p": "I", "g": "I", "os": "G"}));
        assert_eq!(first["collectives"][0]["phase"], "param_gather");
        assert_eq!(first["collectives"][0]["op"], "all_gather");
        assert_eq!(first["collectives"][0]["level"], "intra");
        assert_eq!(value["collectives"], "hierarchical");
        // Every field has a default but model and cluster.
        let minimal = r#"{"model": {"params": 1000}, "cluster": {"world": 2, "group_size": 1,
            "intra_bandwidth": 1, "inter_bandwidth": 1, "memory_bytes": 1000000}}"#;
        assert!(estimate_json(minimal).is_ok());
    }

    #[test]
    fn bad_requests_are_errors() {
        let json_err = |s: &str| matches!(estimate_json(s), Err(ParoError::Json { .. }));
        assert!(json_err("not json"));
        assert!(json_err("{}"));
        assert!(json_err(&EXAMPLE.replace("\"world\"", "\"wrold\"")));
        assert!(json_err(&EXAMPLE.replace("\"hierarchical\"", "\"ring\"")));
        assert!(json_err(&EXAMPLE.replace("\"world\": 64", "\"world\": -1")));
        let topo = estimate_json(&EXAMPLE.replace("\"world\": 64", "\"world\": 60")).unwrap_err();
        assert!(topo.to_string().contains("not divisible by group size 8"), "{topo}");
        let huge = EXAMPLE.replace("\"world\": 64", "\"world\": 18446744073709551615");
        assert!(matches!(estimate_json(&huge), Err(ParoError::Topology(_))));
        for (from, to) in [
            ("\"world\": 64", "\"world\": 0"),
            ("\"group_size\": 8", "\"group_size\": 0"),
            ("\"intra_bandwidth\": 150e9", "\"intra_bandwidth\": 0"),
            ("\"inter_bandwidth\": 12.5e9", "\"inter_bandwidth\": -1"),
            ("\"inter_latency\": 2e-5", "\"inter_latency\": -1"),
            ("\"memory_bytes\": 80000000000", "\"memory_bytes\": 0"),
            ("\"grad_accum\": 4", "\"grad_accum\": 0"),
            ("\"micro_batch\": 2", "\"micro_batch\": 0"),
            ("\"fraction\": 0.0625", "\"fraction\": 2"),
            ("\"fraction\": 0.0625", "\"count\": 1e20"),
            ("{\"preset\": \"llama-65b\"}", "{\"preset\": \"llama-66b\"}"),
            ("{\"preset\": \"llama-65b\"}", "{\"params\": 0}"),
            ("{\"preset\": \"llama-65b\"}", "{}"),
        ] {
            assert!(estimate_json(&EXAMPLE.replace(from, to)).is_err(), "{to}");
        }
        // Sizes that overflow 64-bit byte counts are errors, not panics.
        let big = r#"{"model": {"blocks": [{"numel": 18446744073709551615, "trainable": 18446744073709551615}]},
            "cluster": {"world": 3, "group_size": 1, "intra_bandwidth": 1, "inter_bandwidth": 1, "memory_bytes": 1}}"#;
        assert!(estimate_json(big).is_err());
        let wide = r#"{"model": {"params": 4000000000000000000},
            "cluster": {"world": 8, "group_size": 8, "intra_bandwidth": 1, "inter_bandwidth": 1, "memory_bytes": 1},
            "training": {"grad_accum": 1000000}}"#;
        assert!(estimate_json(wide).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn never_panics(
            world in prop_oneof![Just(0usize), 1usize..80, Just(usize::MAX)],
            group_size in prop_oneof![Just(0usize), 1usize..16],
            numels in prop::collection::vec(prop_oneof![0u64..100, Just(u64::MAX / 3), any::<u64>()], 0..4),
            frac in prop_oneof![Just(0.0f64), 0.0f64..1.0, Just(1.5)],
            accum in prop_oneof![Just(0u64), 1u64..10, Just(u64::MAX)],
            bytes in prop_oneof![Just(0u64), 1u64..8, Just(u64::MAX)],
            flat in any::<bool>(),
        ) {
            let model = if numels.len() == 1 {
                params(numels[0])
            } else {
                blocks(&numels.iter().map(|&n| (n, n / 2)).collect::<Vec<_>>())
            };
            let trainable = (numels.len() == 1).then_some(Trainable::Fraction(frac));
            let mut req = request(model, trainable, Cluster { world, group_size, ..cluster(8) });
            req.training.grad_accum = accum;
            req.training.param_bytes = bytes;
            req.training.optimizer_bytes = bytes;
            req.collectives = if flat { CollectiveAlgorithm::Flat } else { CollectiveAlgorithm::Hierarchical };
            if let Ok(report) = estimate(&req) {
                for s in &report.strategies {
                    prop_assert!(s.time_s.is_finite() && s.time_s >= 0.0);
                    let sum_intra: u64 = s.collectives.iter().map(|c| c.intra_bytes).sum();
                    prop_assert_eq!(sum_intra, s.intra_bytes);
                }
            }
        }

        #[test]
        fn shapes_never_panic(
            h in prop_oneof![Just(0u64), 1u64..5000, Just(u64::MAX)],
            layers in prop_oneof![Just(0u64), 1u64..100, Just(u64::MAX)],
            heads in prop_oneof![Just(0u64), 1u64..64],
            seq in prop_oneof![Just(0u64), 1u64..5000, Just(u64::MAX)],
        ) {
            let shape = LlamaShape {
                hidden_size: h,
                num_hidden_layers: layers,
                intermediate_size: h.saturating_mul(3),
                vocab_size: 32000,
                num_attention_heads: heads,
                num_key_value_heads: None,
                tie_word_embeddings: false,
            };
            let mut req = request(ModelSpec { shape: Some(shape), ..ModelSpec::default() }, None, cluster(16));
            req.training.seq_len = seq;
            let _ = estimate(&req);
        }
    }
}
