//! Runs every rank's plan in an in-memory simulation of the sub-communicators and checks results,
//! stage hazards (see planner [Note: stage semantics]) and bytes per level.

use std::collections::{HashMap, HashSet};

use paro_core::host::waits;
use paro_core::planner::{plan, Buf, ChunkPolicy, Collective, Kind, Level, Plan, Region, Request, Step};
use paro_core::streams::{schedule, Lane};
use paro_core::Topology;

type Op = fn(i64, i64) -> i64;
type Fold = fn(&[i64]) -> i64;
/// Per sub-communicator, per member: the steps issued in a stage with their source data.
type Queues = HashMap<(Level, usize), HashMap<usize, Vec<(Step, Vec<i64>)>>>;

struct Rank {
    bufs: HashMap<Buf, Vec<i64>>,
}

impl Rank {
    fn key(&self, b: Buf, inplace: bool) -> Buf {
        if inplace && b == Buf::Input {
            Buf::Output
        } else {
            b
        }
    }
    fn read(&self, r: &Region, inplace: bool) -> Vec<i64> {
        let v = &self.bufs[&self.key(r.buf, inplace)];
        r.indices().iter().map(|&i| v[i as usize]).collect()
    }
    fn write(&mut self, r: &Region, data: &[i64], inplace: bool) {
        let k = self.key(r.buf, inplace);
        let v = self.bufs.get_mut(&k).unwrap();
        for (&i, &x) in r.indices().iter().zip(data) {
            v[i as usize] = x;
        }
    }
}

fn cells(r: &Region, inplace: bool) -> HashSet<(Buf, u64)> {
    let b = if inplace && r.buf == Buf::Input { Buf::Output } else { r.buf };
    r.indices().into_iter().map(|i| (b, i)).collect()
}

fn contiguous(r: &Region) -> bool {
    r.indices().windows(2).all(|w| w[1] == w[0] + 1)
}

/// (level, which sub-communicator, my index in it, its size)
fn member(t: Topology, flat: bool, rank: usize, level: Level) -> (Level, usize, usize) {
    match level {
        Level::Global => (level, 0, rank),
        _ if flat => panic!("hierarchical level in a flat plan"),
        Level::Intra => (level, t.group_of(rank), t.local_rank(rank)),
        Level::Inter => (level, t.local_rank(rank), t.group_of(rank)),
    }
}

fn simulate(
    t: Topology,
    flat: bool,
    plans: &[Plan],
    inputs: Vec<Vec<i64>>,
    out_len: usize,
    inplace: bool,
    op: Op,
) -> Vec<Vec<i64>> {
    let n = t.world;
    let mut ranks: Vec<Rank> = (0..n)
        .map(|i| {
            let mut bufs = HashMap::new();
            bufs.insert(Buf::Output, if inplace { inputs[i].clone() } else { vec![-7; out_len] });
            bufs.insert(Buf::Input, inputs[i].clone());
            for (j, &len) in plans[i].tmp.iter().enumerate() {
                // scratch buffers are not initialised (planner::Buf::Tmp): garbage that must not reach the output
                bufs.insert(Buf::Tmp(j as u8), vec![777_777_777; len as usize]);
            }
            Rank { bufs }
        })
        .collect();
    let stages = plans.iter().map(Plan::stages).max().unwrap_or(0);
    for stage in 0..stages {
        // (level, comm id) -> per member index: list of (step, src data)
        let mut queues: Queues = HashMap::new();
        for (rank, p) in plans.iter().enumerate() {
            let mut pend_read: HashSet<(Buf, u64)> = HashSet::new();
            let mut pend_write: HashSet<(Buf, u64)> = HashSet::new();
            for s in p.steps.iter().filter(|s| s.stage == stage) {
                let (rd, wr) = (cells(&s.src, inplace), cells(&s.dst, inplace));
                if s.kind.communicates() {
                    assert!(contiguous(&s.src) && contiguous(&s.dst), "comm regions must be contiguous: {s:?}");
                    assert!(
                        rd.is_disjoint(&pend_write) && wr.is_disjoint(&pend_write) && wr.is_disjoint(&pend_read),
                        "overlapping comm steps in stage {stage}: {s:?}"
                    );
                    let data = ranks[rank].read(&s.src, inplace);
                    let (lvl, id, idx) = member(t, flat, rank, s.level);
                    queues.entry((lvl, id)).or_default().entry(idx).or_default().push((*s, data));
                    pend_read.extend(rd);
                    pend_write.extend(wr);
                } else {
                    assert!(rd.is_disjoint(&pend_write), "local step reads a pending comm output: {s:?}");
                    assert!(
                        wr.is_disjoint(&pend_write) && wr.is_disjoint(&pend_read),
                        "local step writes a pending comm region: {s:?}"
                    );
                    let src = ranks[rank].read(&s.src, inplace);
                    let out: Vec<i64> = match s.kind {
                        Kind::Copy => {
                            assert_eq!(s.src.numel(), s.dst.numel());
                            src
                        }
                        Kind::Combine => {
                            let rows = s.src.dims[0] as usize;
                            let w = src.len() / rows;
                            assert_eq!(w as u64, s.dst.numel());
                            (0..w).map(|j| (1..rows).fold(src[j], |a, i| op(a, src[i * w + j]))).collect()
                        }
                        _ => unreachable!(),
                    };
                    ranks[rank].write(&s.dst, &out, inplace);
                }
            }
        }
        for ((level, id), members) in queues {
            let size = members.len();
            let counts: HashSet<usize> = members.values().map(Vec::len).collect();
            assert_eq!(counts.len(), 1, "members of {level:?}/{id} issued different numbers of steps");
            let global = |idx: usize| -> usize {
                match level {
                    Level::Global => idx,
                    Level::Intra => id * t.group_size + idx,
                    Level::Inter => idx * t.group_size + id,
                }
            };
            let expected_size = match level {
                Level::Global => n,
                Level::Intra => t.group_size,
                Level::Inter => t.num_groups(),
            };
            // a rooted step on a rail may involve only that rail's members
            for j in 0..*counts.iter().next().unwrap() {
                let kind = members[&0].get(j).map(|x| x.0.kind).unwrap_or(Kind::Barrier);
                assert_eq!(size, expected_size, "{kind:?} at {level:?} needs all members");
                for x in members.values() {
                    assert_eq!(x[j].0.kind, kind, "mismatched kinds at {level:?}");
                    assert_eq!(x[j].0.src.numel(), members[&0][j].0.src.numel());
                }
                let data = |i: usize| &members[&i][j].1;
                for idx in 0..size {
                    let step = members[&idx][j].0;
                    let res: Option<Vec<i64>> = match kind {
                        Kind::AllGather => Some((0..size).flat_map(|i| data(i).clone()).collect()),
                        Kind::AllToAll => {
                            let p = data(0).len() / size;
                            Some((0..size).flat_map(|i| data(i)[idx * p..(idx + 1) * p].to_vec()).collect())
                        }
                        Kind::AllReduce => Some(
                            (0..data(0).len()).map(|e| (1..size).fold(data(0)[e], |a, i| op(a, data(i)[e]))).collect(),
                        ),
                        Kind::Broadcast => Some(data(step.root as usize).clone()),
                        Kind::Reduce => (idx == step.root as usize).then(|| {
                            (0..data(0).len()).map(|e| (1..size).fold(data(0)[e], |a, i| op(a, data(i)[e]))).collect()
                        }),
                        Kind::Barrier => None,
                        _ => unreachable!(),
                    };
                    if let Some(v) = res {
                        assert_eq!(v.len() as u64, step.dst.numel(), "{kind:?} output size");
                        ranks[global(idx)].write(&step.dst, &v, inplace);
                    }
                }
            }
        }
    }
    ranks.into_iter().map(|r| r.bufs[&Buf::Output].clone()).collect()
}

fn policies() -> Vec<ChunkPolicy> {
    vec![ChunkPolicy::fixed(1 << 30, 8), ChunkPolicy::fixed(1, 8), ChunkPolicy::fixed(8, 3)]
}

fn plans_for(t: Topology, flat: bool, c: Collective, numel: u64, root: usize, chunks: ChunkPolicy) -> Vec<Plan> {
    (0..t.world)
        .map(|rank| {
            plan(&Request {
                collective: c,
                topology: (!flat).then_some(t),
                world: t.world,
                rank,
                numel,
                elem_size: 4,
                root,
                chunks,
            })
            .unwrap()
        })
        .collect()
}

fn shapes() -> Vec<(Topology, bool)> {
    let mut v = Vec::new();
    for g in 1..=4 {
        for m in 1..=4 {
            v.push((Topology::new(g * m, m).unwrap(), false));
        }
    }
    v.push((Topology::new(3, 3).unwrap(), true));
    v.push((Topology::new(6, 6).unwrap(), true));
    v
}

const SIZES: [u64; 7] = [0, 1, 2, 3, 5, 7, 13];

fn val(rank: usize, i: usize) -> i64 {
    (rank as i64 + 1) * 1000 + (i as i64 * 37) % 101
}

#[test]
fn all_gather_matches_definition() {
    for (t, flat) in shapes() {
        for numel in SIZES {
            for pol in policies() {
                let plans = plans_for(t, flat, Collective::AllGather, numel, 0, pol);
                let inputs: Vec<Vec<i64>> =
                    (0..t.world).map(|r| (0..numel as usize).map(|i| val(r, i)).collect()).collect();
                let expected: Vec<i64> = inputs.concat();
                let out = simulate(t, flat, &plans, inputs, expected.len(), false, |a, b| a + b);
                for o in out {
                    assert_eq!(o, expected, "{t:?} flat={flat} numel={numel} {pol:?}");
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_matches_definition() {
    for (t, flat) in shapes() {
        for numel in SIZES {
            for pol in policies() {
                let plans = plans_for(t, flat, Collective::ReduceScatter, numel, 0, pol);
                let n = t.world;
                let len = n * numel as usize;
                let inputs: Vec<Vec<i64>> = (0..n).map(|r| (0..len).map(|i| val(r, i)).collect()).collect();
                let out = simulate(t, flat, &plans, inputs.clone(), numel as usize, false, |a, b| a + b);
                for (rank, o) in out.iter().enumerate() {
                    let exp: Vec<i64> = (0..numel as usize)
                        .map(|j| inputs.iter().map(|x| x[rank * numel as usize + j]).sum())
                        .collect();
                    assert_eq!(o, &exp, "{t:?} flat={flat} numel={numel} {pol:?} rank {rank}");
                }
            }
        }
    }
}

#[test]
fn all_reduce_matches_definition_for_sum_and_max() {
    let ops: [(Op, Fold); 2] = [(|a, b| a + b, |v| v.iter().sum()), (|a, b| a.max(b), |v| *v.iter().max().unwrap())];
    for (t, flat) in shapes() {
        for numel in SIZES {
            for pol in policies() {
                for (op, fold) in ops {
                    let plans = plans_for(t, flat, Collective::AllReduce, numel, 0, pol);
                    let inputs: Vec<Vec<i64>> = (0..t.world)
                        .map(|r| (0..numel as usize).map(|i| val(r, i) * if r % 2 == 0 { 1 } else { -1 }).collect())
                        .collect();
                    let exp: Vec<i64> =
                        (0..numel as usize).map(|j| fold(&inputs.iter().map(|x| x[j]).collect::<Vec<_>>())).collect();
                    let out = simulate(t, flat, &plans, inputs, numel as usize, true, op);
                    for o in out {
                        assert_eq!(o, exp, "{t:?} flat={flat} numel={numel} {pol:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn broadcast_and_reduce_from_every_root() {
    for (t, flat) in shapes() {
        for numel in [0u64, 1, 5] {
            for pol in policies() {
                for root in 0..t.world {
                    let inputs: Vec<Vec<i64>> =
                        (0..t.world).map(|r| (0..numel as usize).map(|i| val(r, i)).collect()).collect();
                    let plans = plans_for(t, flat, Collective::Broadcast, numel, root, pol);
                    let out = simulate(t, flat, &plans, inputs.clone(), numel as usize, true, |a, b| a + b);
                    for o in &out {
                        assert_eq!(o, &inputs[root], "broadcast {t:?} root {root}");
                    }
                    let plans = plans_for(t, flat, Collective::Reduce, numel, root, pol);
                    let out = simulate(t, flat, &plans, inputs.clone(), numel as usize, true, |a, b| a + b);
                    let exp: Vec<i64> = (0..numel as usize).map(|j| inputs.iter().map(|x| x[j]).sum()).collect();
                    assert_eq!(out[root], exp, "reduce {t:?} root {root}");
                }
            }
        }
    }
}

#[test]
fn bytes_per_level_follow_the_ring_formulas() {
    for g in 1..=4u64 {
        for m in 1..=4u64 {
            let t = Topology::new((g * m) as usize, m as usize).unwrap();
            let n = g * m;
            for pol in policies() {
                for numel in [1u64, 6, 24, 25] {
                    for rank in 0..t.world {
                        let req = |c| Request {
                            collective: c,
                            topology: Some(t),
                            world: t.world,
                            rank,
                            numel,
                            elem_size: 4,
                            root: 0,
                            chunks: pol,
                        };
                        // all-gather / reduce-scatter of S = n·numel·4 bytes
                        let s = n * numel * 4;
                        for c in [Collective::AllGather, Collective::ReduceScatter] {
                            let p = plan(&req(c)).unwrap();
                            assert_eq!(p.bytes_at(Level::Inter) * g * m, (g - 1) * s, "{c:?} inter");
                            assert_eq!(p.bytes_at(Level::Intra) * m, (m - 1) * s, "{c:?} intra");
                        }
                        // all-reduce: chunks padded to multiples of n
                        let p = plan(&req(Collective::AllReduce)).unwrap();
                        let single = g == 1 || m == 1; // the level's own all-reduce, one piece
                        let padded: u64 = if single { numel.div_ceil(n) * n } else { p.tmp[0] } * 4;
                        assert_eq!(p.bytes_at(Level::Inter) * g * m, 2 * (g - 1) * padded);
                        assert_eq!(p.bytes_at(Level::Intra) * m, 2 * (m - 1) * padded);
                    }
                }
            }
        }
    }
}

#[test]
fn chunks_pipeline_the_levels() {
    let t = Topology::new(8, 4).unwrap();
    let pol = ChunkPolicy::fixed(64, 4);
    let p = plan(&Request {
        collective: Collective::AllGather,
        topology: Some(t),
        world: 8,
        rank: 5,
        numel: 64,
        elem_size: 4,
        root: 0,
        chunks: pol,
    })
    .unwrap();
    // 4 chunks, 2 comm phases and a copy: 6 stages; stage 1 runs chunk 1's inter and chunk 0's intra phase
    assert_eq!(p.stages(), 6);
    let mut stage1: Vec<(u64, Level)> =
        p.steps.iter().filter(|s| s.stage == 1 && s.kind.communicates()).map(|s| (s.src.offset, s.level)).collect();
    stage1.sort_by_key(|x| x.0);
    // chunk 1 of the input (offset 16) crosses groups while chunk 0 (gathered at offset 0) moves inside the group
    assert_eq!(stage1, vec![(0, Level::Intra), (16, Level::Inter)]);
    // one chunk when asked not to pipeline
    let p = plan(&Request {
        collective: Collective::AllGather,
        topology: Some(t),
        world: 8,
        rank: 5,
        numel: 64,
        elem_size: 4,
        root: 0,
        chunks: ChunkPolicy::fixed(64, 1),
    })
    .unwrap();
    assert_eq!(p.stages(), 3);
}

#[test]
fn bad_requests_are_errors() {
    let t = Topology::new(4, 2).unwrap();
    let base = Request {
        collective: Collective::AllGather,
        topology: Some(t),
        world: 4,
        rank: 0,
        numel: 3,
        elem_size: 4,
        root: 0,
        chunks: ChunkPolicy::default(),
    };
    assert!(plan(&Request { rank: 4, ..base }).is_err());
    assert!(plan(&Request { world: 6, ..base }).is_err());
    assert!(plan(&Request { root: 9, collective: Collective::Broadcast, ..base }).is_err());
}

/// Checks a plan's stream schedule (paro_core::streams, [Note: stream schedule]): builds the happens-before graph
/// of its lanes and events and asserts that every two steps touching a common element run in plan order, and that
/// every step runs after `ready` and before `done`.
fn check_stream_schedule(p: &Plan, inplace: bool, what: &str) {
    let sched = schedule(p);
    let n = p.steps.len();
    let (ready, done) = (n, n + 1);
    let mut preds: Vec<Vec<usize>> = vec![Vec::new(); n + 2];
    let mut last_on_lane: HashMap<Lane, usize> = HashMap::new();
    let mut last_in_stage: Vec<HashMap<Lane, usize>> = vec![HashMap::new(); p.stages() as usize];
    let mut last_local_in_stage: Option<(u32, usize)> = None;
    for (i, s) in p.steps.iter().enumerate() {
        let lane = Lane::of(s);
        assert!(sched.stage_lanes[s.stage as usize] & lane.bit() != 0, "{what}: lane of step {i} not in its stage");
        if let Some(&prev) = last_on_lane.get(&lane) {
            preds[i].push(prev); // a lane runs in order
        }
        if !last_in_stage[s.stage as usize].contains_key(&lane) {
            // the lane's first step of the stage: after the end events of the last stage before it that used any
            // lane (a rank can have nothing to do in a stage), or `ready`
            match (0..s.stage as usize).rev().find(|&k| sched.stage_lanes[k] != 0) {
                None => preds[i].push(ready),
                Some(k) => preds[i].extend(last_in_stage[k].values()),
            }
        }
        if sched.wait_local[i] {
            let (stage, j) = last_local_in_stage.expect("wait_local without a local step before");
            assert_eq!(stage, s.stage, "{what}: wait_local on a local step of another stage");
            preds[i].push(j);
        }
        if lane == Lane::Local {
            last_local_in_stage = Some((s.stage, i));
        }
        last_on_lane.insert(lane, i);
        last_in_stage[s.stage as usize].insert(lane, i);
    }
    match last_in_stage.iter().rev().find(|m| !m.is_empty()) {
        Some(last) => preds[done].extend(last.values()),
        None => preds[done].push(ready),
    }
    // reach[i]: every node that happens before node i
    let mut reach: Vec<HashSet<usize>> = vec![HashSet::new(); n + 2];
    for i in std::iter::once(ready).chain(0..n).chain(std::iter::once(done)) {
        let mut r = HashSet::new();
        for &j in &preds[i] {
            r.insert(j);
            r.extend(reach[j].iter().copied());
        }
        reach[i] = r;
    }
    for i in 0..n {
        assert!(reach[i].contains(&ready) && reach[done].contains(&i), "{what}: step {i} outside ready..done");
    }
    for (b, before_b) in reach.iter().enumerate().take(n) {
        let (rb, wb) = (cells(&p.steps[b].src, inplace), cells(&p.steps[b].dst, inplace));
        for a in 0..b {
            let (ra, wa) = (cells(&p.steps[a].src, inplace), cells(&p.steps[a].dst, inplace));
            let conflict = !wa.is_disjoint(&rb) || !wa.is_disjoint(&wb) || !ra.is_disjoint(&wb);
            assert!(
                !conflict || before_b.contains(&a),
                "{what}: steps {a} {:?} and {b} {:?} conflict but are not ordered",
                p.steps[a],
                p.steps[b]
            );
        }
    }
}

/// Every rank's plans of every collective the schedule tests check: whether it works in place, the plans (one per
/// rank), and a description for failures.
fn schedule_cases() -> Vec<(Topology, bool, bool, Vec<Plan>, String)> {
    let collectives = [
        (Collective::AllGather, false),
        (Collective::ReduceScatter, false),
        (Collective::AllReduce, true),
        (Collective::Broadcast, true),
        (Collective::Reduce, true),
        (Collective::Barrier, false),
    ];
    let mut out = Vec::new();
    for (t, flat) in shapes() {
        for numel in [0, 1, 5, 13] {
            for pol in policies() {
                for (c, inplace) in collectives {
                    for root in [0, t.world - 1] {
                        let what = format!("{c:?} {t:?} flat={flat} n={numel} {pol:?}");
                        out.push((t, flat, inplace, plans_for(t, flat, c, numel, root, pol), what));
                    }
                }
            }
        }
    }
    out
}

#[test]
fn stream_schedules_order_every_conflicting_pair_of_steps() {
    let mut checked = 0;
    let mut waits = 0;
    for (_, _, inplace, plans, what) in schedule_cases() {
        for (rank, p) in plans.iter().enumerate() {
            check_stream_schedule(p, inplace, &format!("{what} rank={rank}"));
            waits += schedule(p).wait_local.iter().filter(|&&w| w).count();
            checked += 1;
        }
    }
    assert!(checked > 1000 && waits > 0, "{checked} plans, {waits} local waits");
}

/// Checks a plan's host schedule (paro_core::host, [Note: host schedule]): walking the steps in order, every step
/// runs after every earlier step it conflicts with has ended (local steps end when the walk passes them,
/// communication steps when a wait names them).
fn check_host_schedule(p: &Plan, inplace: bool, what: &str) {
    let w = waits(p);
    let mut waited: HashSet<usize> = HashSet::new();
    for (b, sb) in p.steps.iter().enumerate() {
        waited.extend(w[b].iter().map(|&j| j as usize));
        let (rb, wb) = (cells(&sb.src, inplace), cells(&sb.dst, inplace));
        for (a, sa) in p.steps.iter().enumerate().take(b) {
            if !sa.kind.communicates() {
                continue;
            }
            let (ra, wa) = (cells(&sa.src, inplace), cells(&sa.dst, inplace));
            let conflict = !wa.is_disjoint(&rb) || !wa.is_disjoint(&wb) || !ra.is_disjoint(&wb);
            assert!(!conflict || waited.contains(&a), "{what}: step {b} {sb:?} does not wait on step {a} {sa:?}");
        }
    }
}

/// A communication step's sub-communicator and its index among that member's steps on it.
type Slot = ((Level, usize), usize);

/// Runs every rank's host walk together, each sub-communicator completing its steps in issue order once all its
/// members have issued them, and asserts that every walk ends (no rank waits on a step another rank never issues).
fn check_host_progress(t: Topology, flat: bool, plans: &[Plan], what: &str) {
    let w: Vec<Vec<Vec<u32>>> = plans.iter().map(waits).collect();
    let n = plans.len();
    let mut pos = vec![0usize; n];
    // per step of each rank: (communicator, index of the step on it for this member)
    let mut slot: Vec<Vec<Option<Slot>>> = Vec::new();
    for (rank, p) in plans.iter().enumerate() {
        let mut count: HashMap<(Level, usize), usize> = HashMap::new();
        slot.push(
            p.steps
                .iter()
                .map(|s| {
                    s.kind.communicates().then(|| {
                        let (lvl, id, _) = member(t, flat, rank, s.level);
                        let c = count.entry((lvl, id)).or_default();
                        *c += 1;
                        ((lvl, id), *c - 1)
                    })
                })
                .collect(),
        );
    }
    let members = |comm: (Level, usize)| -> Vec<usize> {
        (0..n).filter(|&r| comm.0 == Level::Global || member(t, flat, r, comm.0).1 == comm.1).collect()
    };
    let issued = |pos: &[usize], rank: usize, comm: (Level, usize)| -> usize {
        (0..pos[rank]).filter(|&i| slot[rank][i].map(|x| x.0) == Some(comm)).count()
    };
    loop {
        let mut moved = false;
        for rank in 0..n {
            while pos[rank] < plans[rank].steps.len() {
                let i = pos[rank];
                let ready = w[rank][i].iter().all(|&j| {
                    let (comm, k) = slot[rank][j as usize].unwrap();
                    // in issue order: the step and every earlier one on the communicator issued by all its members
                    members(comm).iter().all(|&r| issued(&pos, r, comm) > k)
                });
                if !ready {
                    break;
                }
                pos[rank] += 1;
                moved = true;
            }
        }
        if pos.iter().zip(plans).all(|(&p, plan)| p == plan.steps.len()) {
            return;
        }
        assert!(moved, "{what}: the host walks wait on each other at {pos:?}");
    }
}

#[test]
fn host_schedules_order_every_conflicting_pair_and_never_deadlock() {
    let mut checked = 0;
    for (t, flat, inplace, plans, what) in schedule_cases() {
        for (rank, p) in plans.iter().enumerate() {
            check_host_schedule(p, inplace, &format!("{what} rank={rank}"));
            checked += 1;
        }
        check_host_progress(t, flat, &plans, &what);
    }
    assert!(checked > 1000, "{checked} plans");
}
