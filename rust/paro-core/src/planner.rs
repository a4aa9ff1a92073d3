//! Hierarchical collective planner (PaRO-CC / HO-Ring): turns one collective into stages of
//! sub-collectives on the intra-group and inter-group (same-rail) sub-communicators plus local copies
//! and reductions, chunked so that chunk c's inter phase runs while chunk c−1's intra phase runs.
//!
//! [Note: stage semantics] An executor runs a plan stage by stage. Inside a stage it walks the steps in
//! order: local steps (`Copy`, `Combine`) run at once; communication steps are *issued* (asynchronously,
//! in plan order per level, the same order on every rank); at the end of the stage it waits for all of
//! them. The planner guarantees that no local step touches a region an issued step of the same stage
//! writes, nor writes a region it reads, so the phases of different chunks overlap safely.
//!
//! Every algorithm is written for g groups of m ranks; when a level has a single rank its
//! communication step becomes a local copy, so one code path serves 2-level, intra-only and
//! inter-only (flat) topologies. All-gather, reduce-scatter and all-reduce on one level only skip
//! that path: they run as the level's own collective (reduce-scatter as all-to-all + combine), without
//! staging through scratch buffers.
//!
//! [Note: order inside a stage] Chunk c's steps of phase p (its p-th stage) run in stage c + p. Inside a stage the
//! steps are ordered by phase, so a later chunk's earlier phase comes first (in stage 2 of an all-gather: chunk 2's
//! inter step, then chunk 1's intra step, then chunk 0's copy), and a chunk's own steps keep their order. An
//! executor that walks the plan in order and waits only where a step needs an earlier one (the CPU path,
//! `crate::host`) has then always issued the next chunk's step of a level before it waits on the current one, so
//! no link idles between chunks.

use serde::{Deserialize, Serialize};

pub use crate::comm::{Collective, Level};
use crate::cost::Link;
use crate::error::{ParoError, Result};
use crate::topology::Topology;

/// A buffer a step reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Buf {
    /// The caller's input tensor (for in-place collectives, the same as `Output`).
    Input,
    /// The caller's output tensor.
    Output,
    /// A scratch buffer of the plan, `Plan::tmp[i]` elements, not initialised: no element a plan has not written
    /// reaches the output (an all-reduce's padding is reduced with the rest and then dropped).
    Tmp(u8),
}

/// A strided 3-D view of a buffer, in elements. Communication steps only use contiguous regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// The buffer.
    pub buf: Buf,
    /// First element.
    pub offset: u64,
    /// Sizes of the three dimensions.
    pub dims: [u64; 3],
    /// Strides of the three dimensions.
    pub strides: [u64; 3],
}

impl Region {
    /// A contiguous run of `numel` elements.
    pub fn flat(buf: Buf, offset: u64, numel: u64) -> Self {
        Region { buf, offset, dims: [1, 1, numel], strides: [numel, numel, 1] }
    }

    /// A contiguous `[a, b]` matrix (as `[a, 1, b]`).
    pub fn rows(buf: Buf, offset: u64, a: u64, b: u64) -> Self {
        Region { buf, offset, dims: [a, 1, b], strides: [b, b, 1] }
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Element indices covered, in iteration order (for tests and checks).
    pub fn indices(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.numel() as usize);
        for a in 0..self.dims[0] {
            for b in 0..self.dims[1] {
                for c in 0..self.dims[2] {
                    out.push(self.offset + a * self.strides[0] + b * self.strides[1] + c * self.strides[2]);
                }
            }
        }
        out
    }
}

/// What a step does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Kind {
    /// `dst` = concatenation over the level's ranks of their `src` (contiguous).
    AllGather,
    /// Piece i of `src` goes to the level's rank i; piece j of `dst` comes from rank j (equal pieces).
    AllToAll,
    /// `src` = `dst`, reduced in place at the level (the call's reduce op).
    AllReduce,
    /// `dst` (= `src`) broadcast from the level's rank `root`.
    Broadcast,
    /// `dst` (= `src`) reduced onto the level's rank `root`.
    Reduce,
    /// Synchronise the level.
    Barrier,
    /// Local: `dst` = `src` (same shape, any strides).
    Copy,
    /// Local: `dst[b, c]` = reduce over a of `src[a, b, c]` with the call's reduce op; `dst` has dims `[1, b, c]`.
    Combine,
}

impl Kind {
    /// True for steps that communicate.
    pub fn communicates(self) -> bool {
        !matches!(self, Kind::Copy | Kind::Combine)
    }
}

/// One step of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// Stage the step belongs to (see [Note: stage semantics]).
    pub stage: u32,
    /// What to do.
    pub kind: Kind,
    /// Sub-communicator (ignored by local steps).
    pub level: Level,
    /// Source region.
    pub src: Region,
    /// Destination region.
    pub dst: Region,
    /// Root rank within the level, for `Broadcast` and `Reduce`.
    pub root: u32,
    /// Bytes this rank sends in this step (ring/pairwise algorithms; see each collective's doc).
    pub bytes: u64,
}

/// How messages are cut into chunks to pipeline the levels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkPolicy {
    /// Target chunk size in bytes; a message gets ceil(bytes / chunk_bytes) chunks. 0: the count comes from
    /// `links` (see [`ChunkPolicy::from_links`]), or from the default when they are not known.
    pub chunk_bytes: u64,
    /// Upper bound on the chunk count (1 = phases run one after the other).
    pub max_chunks: u32,
    /// The intra-group and inter-group links, for `chunk_bytes` 0.
    pub links: Option<(Link, Link)>,
}

impl ChunkPolicy {
    /// A fixed target chunk size and upper bound on the count.
    pub fn fixed(chunk_bytes: u64, max_chunks: u32) -> Self {
        ChunkPolicy { chunk_bytes, max_chunks, links: None }
    }

    /// Chunks of a message of `bytes` bytes: ceil(bytes / chunk_bytes), between 1 and `max_chunks`.
    pub fn count(&self, bytes: u64) -> u64 {
        let chunk = if self.chunk_bytes == 0 { ChunkPolicy::default().chunk_bytes } else { self.chunk_bytes };
        bytes.div_ceil(chunk.max(1)).clamp(1, u64::from(self.max_chunks.max(1)))
    }

    /// The chunk count of a two-level collective from its links. Walked as the CPU executor walks a plan (see
    /// [Note: host schedule] in host.rs), C chunks take about max(T_a, T_b) + min(T_a, T_b) / C + C·α: the busier
    /// level's time, the other level's time for one chunk (the pipeline's fill or drain) and, per chunk, α, the
    /// latency of every communication step of one chunk (a ring step per peer). T is a level's bytes over its
    /// bandwidth, from the one-chunk plan (`one`). The count minimising it is sqrt(min(T_a, T_b) / α), between 1
    /// and `max_chunks`.
    pub fn from_links(one: &Plan, intra: Link, inter: Link, sizes: (u64, u64), max_chunks: u32) -> u64 {
        let time = |level: Level, link: Link| {
            if link.bandwidth > 0.0 {
                one.bytes_at(level) as f64 / link.bandwidth
            } else {
                0.0
            }
        };
        let (t_a, t_b) = (time(Level::Intra, intra), time(Level::Inter, inter));
        let alpha: f64 = one
            .steps
            .iter()
            .filter(|s| s.kind.communicates())
            .map(|s| match s.level {
                Level::Intra => intra.latency * sizes.0.saturating_sub(1) as f64,
                _ => inter.latency * sizes.1.saturating_sub(1) as f64,
            })
            .sum();
        let fill = t_a.min(t_b);
        let best = if alpha > 0.0 { (fill / alpha).sqrt().round() } else { f64::from(max_chunks) };
        (best as u64).clamp(1, u64::from(max_chunks.max(1)))
    }
}

impl Default for ChunkPolicy {
    fn default() -> Self {
        ChunkPolicy { chunk_bytes: 1 << 20, max_chunks: 8, links: None }
    }
}

/// What to plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    /// The collective.
    pub collective: Collective,
    /// The process group as groups; `None` runs flat (one level over all ranks).
    pub topology: Option<Topology>,
    /// Number of ranks in the process group (must equal `topology.world` when given).
    pub world: usize,
    /// This rank within the process group.
    pub rank: usize,
    /// Elements per rank block (all-gather, reduce-scatter) or of the whole tensor (the others).
    pub numel: u64,
    /// Bytes per element.
    pub elem_size: u64,
    /// Root rank (broadcast, reduce).
    pub root: usize,
    /// Chunking.
    pub chunks: ChunkPolicy,
}

/// The steps one rank runs for one collective.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Sizes in elements of the scratch buffers `Buf::Tmp(i)`.
    pub tmp: Vec<u64>,
    /// Steps, grouped by increasing stage.
    pub steps: Vec<Step>,
}

impl Plan {
    /// Number of stages.
    pub fn stages(&self) -> u32 {
        self.steps.iter().map(|s| s.stage + 1).max().unwrap_or(0)
    }

    /// Bytes this rank sends at a level.
    pub fn bytes_at(&self, level: Level) -> u64 {
        self.steps.iter().filter(|s| s.kind.communicates() && s.level == level).map(|s| s.bytes).sum()
    }
}

/// Splits `numel` elements into chunks: `(offset, len)`, all non-empty.
fn split_chunks(numel: u64, elem_size: u64, policy: ChunkPolicy) -> Vec<(u64, u64)> {
    if numel == 0 {
        return Vec::new();
    }
    let bytes = numel.saturating_mul(elem_size.max(1));
    let count = policy.count(bytes).min(numel);
    let base = numel / count;
    let extra = numel % count;
    let mut out = Vec::with_capacity(count as usize);
    let mut off = 0;
    for i in 0..count {
        let len = base + u64::from(i < extra);
        out.push((off, len));
        off += len;
    }
    out
}

/// This rank's view of a rooted step's level: its size, this rank's and the root's index in it.
#[derive(Clone, Copy)]
struct Peers {
    size: u64,
    me: u64,
    root: u64,
}

/// Accumulates steps.
struct Builder {
    steps: Vec<Step>,
    /// Per step, the chunk it belongs to (see [Note: order inside a stage]).
    chunk_of: Vec<u32>,
    /// The chunk the steps pushed now belong to.
    chunk: u32,
    elem: u64,
}

impl Builder {
    fn push(&mut self, step: Step) {
        self.steps.push(step);
        self.chunk_of.push(self.chunk);
    }

    fn local(&mut self, stage: u32, kind: Kind, src: Region, dst: Region) {
        self.push(Step { stage, kind, level: Level::Global, src, dst, root: 0, bytes: 0 });
    }

    /// An all-gather among `size` ranks at `level`, or a copy when the level has one rank.
    fn all_gather(&mut self, stage: u32, level: Level, size: u64, src: Region, dst: Region) {
        if size == 1 {
            return self.local(stage, Kind::Copy, src, dst);
        }
        let bytes = (size - 1) * src.numel() * self.elem;
        self.push(Step { stage, kind: Kind::AllGather, level, src, dst, root: 0, bytes });
    }

    /// An all-to-all among `size` ranks at `level`, or a copy when the level has one rank.
    fn all_to_all(&mut self, stage: u32, level: Level, size: u64, src: Region, dst: Region) {
        if size == 1 {
            return self.local(stage, Kind::Copy, src, dst);
        }
        let bytes = (size - 1) * (src.numel() / size) * self.elem;
        self.push(Step { stage, kind: Kind::AllToAll, level, src, dst, root: 0, bytes });
    }

    /// An in-place all-reduce among `size` ranks at `level` (nothing when the level has one rank); nominal
    /// bytes: a ring's 2(size−1) pieces of numel/size, rounded up.
    fn all_reduce(&mut self, stage: u32, level: Level, size: u64, region: Region) {
        if size == 1 {
            return;
        }
        let bytes = 2 * (size - 1) * region.numel().div_ceil(size) * self.elem;
        self.push(Step { stage, kind: Kind::AllReduce, level, src: region, dst: region, root: 0, bytes });
    }

    /// A rooted step (broadcast or reduce); nominal bytes: the root sends the buffer to each other rank
    /// (broadcast), each other rank sends it once (reduce).
    fn rooted(&mut self, stage: u32, kind: Kind, level: Level, peers: Peers, region: Region) {
        let Peers { size, me, root } = peers;
        if size == 1 {
            return;
        }
        let n = region.numel() * self.elem;
        let bytes = match (kind, me == root) {
            (Kind::Broadcast, true) => (size - 1) * n,
            (Kind::Reduce, false) => n,
            _ => 0,
        };
        self.push(Step { stage, kind, level, src: region, dst: region, root: root as u32, bytes });
    }
}

/// Plans one collective for one rank.
///
/// Bytes per rank, with S the total bytes of the gathered buffer (all-gather, reduce-scatter) or of the
/// tensor padded to a multiple of n (all-reduce), g groups of m ranks:
/// all-gather and reduce-scatter send (g−1)/g·S/m inter and (m−1)/m·S intra;
/// all-reduce sends 2(g−1)/g·S/m inter and 2(m−1)/m·S intra.
pub fn plan(req: &Request) -> Result<Plan> {
    let topo = match req.topology {
        Some(t) => {
            if t.world != req.world {
                return Err(ParoError::Invalid(format!(
                    "topology has {} ranks but the process group has {}",
                    t.world, req.world
                )));
            }
            t
        }
        None => Topology::new(req.world, req.world)?,
    };
    topo.check_rank(req.rank)?;
    if req.root >= req.world {
        return Err(ParoError::Invalid(format!("root rank {} is out of range for {} ranks", req.root, req.world)));
    }
    let flat = req.topology.is_none();
    let (intra, inter) = if flat { (Level::Global, Level::Global) } else { (Level::Intra, Level::Inter) };
    let g = topo.num_groups() as u64;
    let m = topo.group_size as u64;
    let k = topo.group_of(req.rank) as u64;
    let r = topo.local_rank(req.rank) as u64;
    let n = g * m;
    let e = req.elem_size;
    let big_n = req.numel;
    // One level only (flat, intra-only or inter-only): no overlap to gain from chunking.
    let policy = match req.chunks {
        _ if g == 1 || m == 1 => ChunkPolicy { max_chunks: 1, ..req.chunks },
        ChunkPolicy { chunk_bytes: 0, max_chunks, links: Some((intra_link, inter_link)) } if max_chunks > 1 => {
            let one = plan(&Request { chunks: ChunkPolicy::fixed(u64::MAX, 1), ..*req })?;
            let count = ChunkPolicy::from_links(&one, intra_link, inter_link, (m, g), max_chunks);
            let bytes = req.numel.saturating_mul(req.elem_size.max(1));
            ChunkPolicy::fixed(bytes.div_ceil(count).max(1), count as u32)
        }
        p => p,
    };
    let mut b = Builder { steps: Vec::new(), chunk_of: Vec::new(), chunk: 0, elem: e };
    let t = |i: u8| Buf::Tmp(i);
    let single = if m == 1 {
        Some((inter, g))
    } else if g == 1 {
        Some((intra, m))
    } else {
        None
    };
    let tmp: Vec<u64> = match (req.collective, single) {
        // One level only: that level's own collective, no staging through scratch buffers.
        (Collective::AllGather, Some((level, size))) if big_n > 0 => {
            b.all_gather(0, level, size, Region::flat(Buf::Input, 0, big_n), Region::flat(Buf::Output, 0, n * big_n));
            vec![]
        }
        (Collective::ReduceScatter, Some((level, size))) if big_n > 0 => {
            b.all_to_all(0, level, size, Region::flat(Buf::Input, 0, n * big_n), Region::flat(t(0), 0, n * big_n));
            b.local(1, Kind::Combine, Region::rows(t(0), 0, n, big_n), Region::flat(Buf::Output, 0, big_n));
            vec![n * big_n]
        }
        (Collective::AllReduce, Some((level, size))) if big_n > 0 => {
            b.all_reduce(0, level, size, Region::flat(Buf::Output, 0, big_n));
            vec![]
        }
        (Collective::Barrier, _) => {
            let none = Region::flat(Buf::Input, 0, 0);
            b.push(Step {
                stage: 0,
                kind: Kind::Barrier,
                level: Level::Global,
                src: none,
                dst: none,
                root: 0,
                bytes: 0,
            });
            vec![]
        }
        (Collective::AllGather, _) => {
            // Inter all-gather among the rail (blocks (k', r) for all k'), then intra all-gather of those
            // g blocks, then a local transpose into rank order k'·m + r'.
            for (c, (off, len)) in split_chunks(big_n, e, policy).into_iter().enumerate() {
                let stage = c as u32;
                b.chunk = stage;
                b.all_gather(stage, inter, g, Region::flat(Buf::Input, off, len), Region::flat(t(0), g * off, g * len));
                b.all_gather(
                    stage + 1,
                    intra,
                    m,
                    Region::flat(t(0), g * off, g * len),
                    Region::flat(t(1), n * off, n * len),
                );
                let src = Region { buf: t(1), offset: n * off, dims: [g, m, len], strides: [len, g * len, 1] };
                let dst = Region { buf: Buf::Output, offset: off, dims: [g, m, len], strides: [m * big_n, big_n, 1] };
                b.local(stage + 2, Kind::Copy, src, dst);
            }
            vec![g * big_n, n * big_n]
        }
        (Collective::ReduceScatter, _) => {
            // Permute so that intra peer r' receives blocks (k', r') for all k'; intra all-to-all + local
            // reduction; inter all-to-all of the g partial blocks + local reduction.
            for (c, (off, len)) in split_chunks(big_n, e, policy).into_iter().enumerate() {
                let stage = c as u32;
                b.chunk = stage;
                let src = Region { buf: Buf::Input, offset: off, dims: [m, g, len], strides: [big_n, m * big_n, 1] };
                let packed = Region { buf: t(0), offset: n * off, dims: [m, g, len], strides: [g * len, len, 1] };
                b.local(stage, Kind::Copy, src, packed);
                b.all_to_all(
                    stage,
                    intra,
                    m,
                    Region::flat(t(0), n * off, n * len),
                    Region::flat(t(1), n * off, n * len),
                );
                b.local(
                    stage + 1,
                    Kind::Combine,
                    Region::rows(t(1), n * off, m, g * len),
                    Region::flat(t(2), g * off, g * len),
                );
                b.all_to_all(
                    stage + 1,
                    inter,
                    g,
                    Region::flat(t(2), g * off, g * len),
                    Region::flat(t(3), g * off, g * len),
                );
                b.local(
                    stage + 2,
                    Kind::Combine,
                    Region::rows(t(3), g * off, g, len),
                    Region::flat(Buf::Output, off, len),
                );
            }
            vec![n * big_n, n * big_n, g * big_n, g * big_n]
        }
        (Collective::AllReduce, _) => {
            // Each chunk padded to a multiple of n: intra reduce-scatter (all-to-all + combine), inter
            // reduce-scatter, inter all-gather, intra all-gather. Inter traffic: 1/m of the chunk.
            let mut poff = 0;
            for (c, (off, len)) in split_chunks(big_n, e, policy).into_iter().enumerate() {
                let stage = c as u32;
                b.chunk = stage;
                let plen = len.div_ceil(n) * n;
                let q = plen / m;
                let s = plen / n;
                let (qoff, soff) = (poff / m, poff / n);
                b.local(stage, Kind::Copy, Region::flat(Buf::Input, off, len), Region::flat(t(0), poff, len));
                b.all_to_all(stage, intra, m, Region::flat(t(0), poff, plen), Region::flat(t(1), poff, plen));
                b.local(stage + 1, Kind::Combine, Region::rows(t(1), poff, m, q), Region::flat(t(2), qoff, q));
                b.all_to_all(stage + 1, inter, g, Region::flat(t(2), qoff, q), Region::flat(t(3), qoff, q));
                b.local(stage + 2, Kind::Combine, Region::rows(t(3), qoff, g, s), Region::flat(t(4), soff, s));
                b.all_gather(stage + 2, inter, g, Region::flat(t(4), soff, s), Region::flat(t(2), qoff, q));
                b.all_gather(stage + 3, intra, m, Region::flat(t(2), qoff, q), Region::flat(t(1), poff, plen));
                b.local(stage + 4, Kind::Copy, Region::flat(t(1), poff, len), Region::flat(Buf::Output, off, len));
                poff += plen;
            }
            vec![poff, poff, poff / m, poff / m, poff / n]
        }
        (Collective::Broadcast | Collective::Reduce, _) => {
            let (kr, rr) = (topo.group_of(req.root) as u64, topo.local_rank(req.root) as u64);
            let kind = if req.collective == Collective::Broadcast { Kind::Broadcast } else { Kind::Reduce };
            for (c, (off, len)) in split_chunks(big_n, e, policy).into_iter().enumerate() {
                let region = Region::flat(Buf::Output, off, len);
                let stage = c as u32;
                b.chunk = stage;
                if kind == Kind::Broadcast {
                    // root's rail first, then inside every group from the rail member
                    if r == rr {
                        b.rooted(stage, kind, inter, Peers { size: g, me: k, root: kr }, region);
                    }
                    b.rooted(stage + 1, kind, intra, Peers { size: m, me: r, root: rr }, region);
                } else {
                    // inside every group onto the root's local rank, then along the root's rail
                    b.rooted(stage, kind, intra, Peers { size: m, me: r, root: rr }, region);
                    if r == rr {
                        b.rooted(stage + 1, kind, inter, Peers { size: g, me: k, root: kr }, region);
                    }
                }
            }
            vec![]
        }
    };
    // [Note: order inside a stage]
    let mut order: Vec<(u32, u32, Step)> =
        b.steps.into_iter().zip(b.chunk_of).map(|(s, c)| (s.stage, s.stage - c, s)).collect();
    order.sort_by_key(|&(stage, phase, _)| (stage, phase)); // stable: keeps a chunk's own order
    Ok(Plan { tmp, steps: order.into_iter().map(|(_, _, s)| s).collect() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_gather(chunks: ChunkPolicy) -> Plan {
        // 2 groups of 2, 4 MiB per rank (a 16 MiB all-gather)
        plan(&Request {
            collective: Collective::AllGather,
            topology: Some(Topology::new(4, 2).unwrap()),
            world: 4,
            rank: 1,
            numel: 1 << 20,
            elem_size: 4,
            root: 0,
            chunks,
        })
        .unwrap()
    }

    fn inter_steps(p: &Plan) -> usize {
        p.steps.iter().filter(|s| s.kind.communicates() && s.level == Level::Inter).count()
    }

    #[test]
    fn the_chunk_count_follows_the_links() {
        let one = all_gather(ChunkPolicy::fixed(u64::MAX, 1));
        // 200 Mbit/s shared by a node's 2 ranks (12.5 MB/s each), 1 GB/s inside the node, 0.1 ms per ring step:
        // the intra level's 8 MiB take 8.4 ms, so sqrt(8.4 ms / 0.2 ms) ≈ 6 chunks
        let (intra, inter) = (Link::new(1e9, 1e-4), Link::new(12.5e6, 1e-4));
        assert_eq!(ChunkPolicy::from_links(&one, intra, inter, (2, 2), 64), 6);
        // latency dominating: one chunk; no latency: as many as allowed
        assert_eq!(ChunkPolicy::from_links(&one, intra, Link::new(12.5e6, 1.0), (2, 2), 64), 1);
        assert_eq!(ChunkPolicy::from_links(&one, Link::new(1e9, 0.0), Link::new(12.5e6, 0.0), (2, 2), 16), 16);
        // the planner cuts the message into that many chunks when asked to take the count from the links
        let p = all_gather(ChunkPolicy { chunk_bytes: 0, max_chunks: 64, links: Some((intra, inter)) });
        assert_eq!(inter_steps(&p), 6);
        // a fixed chunk size still wins, and without links chunk_bytes 0 is the default size
        assert_eq!(inter_steps(&all_gather(ChunkPolicy::fixed(1 << 20, 64))), 4);
        assert_eq!(inter_steps(&all_gather(ChunkPolicy { chunk_bytes: 0, max_chunks: 64, links: None })), 4);
    }
}
