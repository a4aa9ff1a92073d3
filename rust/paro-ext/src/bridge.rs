//! The cxx bridge between the Rust planner and the C++ c10d backend (cpp/).

use paro_core::cost::Link;
use paro_core::planner::{
    self, Buf, ChunkPolicy, Collective, Kind as CoreKind, Level as CoreLevel, Region as CoreRegion,
};
use paro_core::{host, streams, Topology};

#[cxx::bridge(namespace = "paro")]
pub mod ffi {
    /// Sub-communicator of a step.
    #[derive(Debug, Clone, Copy)]
    #[repr(u8)]
    enum Level {
        Intra,
        Inter,
        Global,
    }

    /// What a step does.
    #[derive(Debug, Clone, Copy)]
    #[repr(u8)]
    enum Kind {
        AllGather,
        AllToAll,
        AllReduce,
        Broadcast,
        Reduce,
        Barrier,
        Copy,
        Combine,
    }

    /// The collective the C++ side asks to plan.
    #[derive(Debug, Clone, Copy)]
    #[repr(u8)]
    enum CollectiveOp {
        AllGather,
        ReduceScatter,
        AllReduce,
        Broadcast,
        Reduce,
        Barrier,
    }

    /// A strided 3-D view: buf 0 = input, 1 = output, 2 + i = scratch i.
    #[derive(Debug, Clone, Copy)]
    struct Region {
        buf: u8,
        offset: i64,
        d0: i64,
        d1: i64,
        d2: i64,
        s0: i64,
        s1: i64,
        s2: i64,
    }

    /// One plan step (see planner::Step).
    #[derive(Debug, Clone)]
    struct Step {
        stage: u32,
        kind: Kind,
        level: Level,
        src: Region,
        dst: Region,
        root: i32,
        bytes: u64,
        /// On a device: the step's stream first waits on the local steps before it in its stage
        /// (paro_core::streams, [Note: stream schedule]).
        wait_local: bool,
        /// On the CPU: the earlier communication steps (indices into the plan's steps) to wait on before this
        /// step runs or is issued (paro_core::host, [Note: host schedule]).
        waits: Vec<u32>,
    }

    /// A plan: scratch sizes, steps, and per stage the mask of the streams it uses on a device
    /// (bit 0 intra, 1 inter, 2 global, 3 local; see paro_core::streams).
    #[derive(Debug, Clone)]
    struct PlanOut {
        tmp: Vec<i64>,
        steps: Vec<Step>,
        stage_lanes: Vec<u8>,
    }

    /// The process group as seen by one rank; group_size 0 means flat (no hierarchy).
    #[derive(Debug, Clone, Copy)]
    struct Shape {
        world: i32,
        group_size: i32,
        rank: i32,
        chunk_bytes: u64,
        max_chunks: u32,
        /// Link figures the chunk count comes from when `chunk_bytes` is 0 (paro_core::planner::ChunkPolicy):
        /// bytes per second per rank and seconds per step, intra then inter; a bandwidth of 0 is unknown.
        links: [f64; 4],
    }

    extern "Rust" {
        fn make_plan(op: CollectiveOp, shape: &Shape, numel: u64, elem_size: u64, root: i32) -> Result<PlanOut>;
    }

    unsafe extern "C++" {
        include!("cpp/bridge.h");

        /// See cpp/bridge.h.
        unsafe fn create_backend(
            shape: &Shape,
            intra: usize,
            inter: usize,
            global: usize,
            device_key: i64,
        ) -> Result<usize>;
        /// See cpp/bridge.h.
        unsafe fn set_device_factory(callable: usize) -> Result<()>;
        /// See cpp/bridge.h.
        unsafe fn backend_stats(backend: usize) -> Result<Vec<u64>>;
        /// See cpp/bridge.h.
        unsafe fn reset_backend_stats(backend: usize) -> Result<()>;
    }
}

use ffi::{CollectiveOp, Kind, Level, PlanOut, Region, Shape, Step};

fn region(r: &CoreRegion) -> Region {
    let buf = match r.buf {
        Buf::Input => 0,
        Buf::Output => 1,
        Buf::Tmp(i) => 2 + i,
    };
    let [d0, d1, d2] = r.dims.map(|x| x as i64);
    let [s0, s1, s2] = r.strides.map(|x| x as i64);
    Region { buf, offset: r.offset as i64, d0, d1, d2, s0, s1, s2 }
}

/// Builds the topology of a shape: `None` when flat.
pub fn topology_of(shape: &Shape) -> Result<Option<Topology>, paro_core::ParoError> {
    if shape.world <= 0 || shape.rank < 0 || shape.group_size < 0 {
        return Err(paro_core::ParoError::Topology(format!("invalid process group shape {shape:?}")));
    }
    if shape.group_size == 0 {
        return Ok(None);
    }
    Topology::new(shape.world as usize, shape.group_size as usize).map(Some)
}

/// Plans one collective; reached from C++, so it returns errors and never panics.
fn make_plan(op: CollectiveOp, shape: &Shape, numel: u64, elem_size: u64, root: i32) -> Result<PlanOut, String> {
    let result = std::panic::catch_unwind(|| -> Result<PlanOut, String> {
        let topology = topology_of(shape).map_err(|e| e.to_string())?;
        let collective = match op {
            CollectiveOp::AllGather => Collective::AllGather,
            CollectiveOp::ReduceScatter => Collective::ReduceScatter,
            CollectiveOp::AllReduce => Collective::AllReduce,
            CollectiveOp::Broadcast => Collective::Broadcast,
            CollectiveOp::Reduce => Collective::Reduce,
            CollectiveOp::Barrier => Collective::Barrier,
            _ => return Err("paro: unknown collective".into()),
        };
        let req = planner::Request {
            collective,
            topology,
            world: shape.world as usize,
            rank: shape.rank as usize,
            numel,
            elem_size,
            root: root.max(0) as usize,
            chunks: ChunkPolicy {
                chunk_bytes: shape.chunk_bytes,
                max_chunks: shape.max_chunks,
                links: match shape.links {
                    [bi, li, be, le] if bi > 0.0 && be > 0.0 => Some((Link::new(bi, li), Link::new(be, le))),
                    _ => None,
                },
            },
        };
        let plan = planner::plan(&req).map_err(|e| format!("paro: {e}"))?;
        let lanes = streams::schedule(&plan);
        let waits = host::waits(&plan);
        let steps = plan
            .steps
            .iter()
            .zip(&lanes.wait_local)
            .zip(waits)
            .map(|((s, &wait_local), waits)| Step {
                stage: s.stage,
                kind: match s.kind {
                    CoreKind::AllGather => Kind::AllGather,
                    CoreKind::AllToAll => Kind::AllToAll,
                    CoreKind::AllReduce => Kind::AllReduce,
                    CoreKind::Broadcast => Kind::Broadcast,
                    CoreKind::Reduce => Kind::Reduce,
                    CoreKind::Barrier => Kind::Barrier,
                    CoreKind::Copy => Kind::Copy,
                    CoreKind::Combine => Kind::Combine,
                },
                level: match s.level {
                    CoreLevel::Intra => Level::Intra,
                    CoreLevel::Inter => Level::Inter,
                    CoreLevel::Global => Level::Global,
                },
                src: region(&s.src),
                dst: region(&s.dst),
                root: s.root as i32,
                bytes: s.bytes,
                wait_local,
                waits,
            })
            .collect();
        Ok(PlanOut { tmp: plan.tmp.iter().map(|&x| x as i64).collect(), steps, stage_lanes: lanes.stage_lanes })
    });
    result.unwrap_or_else(|_| Err("paro: internal error while planning (a bug; please report it)".into()))
}
